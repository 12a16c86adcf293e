//! `DeliveryMode::WorkerPool`: runners are jobs on bounded queues served by
//! a fixed set of threads, one queue per worker.
//!
//! # Where work goes
//! - A publish goes to its route's *home* worker (`registry/route.rs`: routes
//!   get homes in turn). So one topic's publishes run one after another on
//!   one thread, and two busy topics run on two. Handlers that share state
//!   (one counter for all) then never fight over it between cores, and
//!   handlers with state of their own keep it in one core's cache; with a
//!   publish cut into per-worker chunks, the first kind ran 3-4x slower than
//!   on one core (see `docs/design-notes.md`, "Where a subscription runs").
//!   The one exception is `Batch::Single` below the threshold: there every
//!   subscription is a unit of its own (BlazeSub's individual delivery),
//!   and the units go to the queues in turn.
//! - A worker that takes a publish also takes the publishes queued right
//!   behind it on the same queue to the same subscriptions, up to
//!   [`MAX_BATCH`] in all, and runs them subscription by subscription
//!   ([`Batch`]): the entries are walked once per batch, and an ordered
//!   subscription takes its messages of the batch in one turn. Only what is
//!   already queued is batched, so a lone publish waits for nothing.
//! - A lone publish (nothing queued behind it) claims its units from the
//!   job's cursor (a chunk above the threshold, a subscription below it)
//!   and enlists helpers: it *posts* itself, and every worker looks at the
//!   post before it waits, so a big or slow publish uses every free worker.
//! - A worker with nothing of its own joins or takes another worker's work
//!   only when that worker has started nothing new for [`STALL`] (a slow
//!   handler, or a long batch). It first joins what that worker runs (a
//!   batch or a lone publish, shown in the worker's `running` slot: it
//!   claims the subscriptions not yet claimed, so a handler that blocks
//!   holds up only the subscriptions claimed with it); then it takes at
//!   most half of what is queued there, as one batch (work stealing's
//!   rule: the owner keeps the rest). Until then it watches, waking every
//!   `STALL`. Taking at once, as an idle worker did before, put two cores
//!   on one topic's handlers during every burst.
//! - No work is left queued, or unclaimed in a running batch, behind a
//!   stalled worker while another waits for ever. A worker that announces
//!   its wait looks once more for such work of a worker that is not
//!   waiting, and watches it instead of waiting; a publisher that queues
//!   for a busy worker, or a worker about to run something with more
//!   queued behind it or with units another could join, wakes a waiting
//!   one. The
//!   two sides store before they load, so one of them always sees the
//!   other (`loom_tests.rs` checks both with a handler that blocks until
//!   the others have run).
//!
//! A queue holds `queue_capacity / workers` tickets (at least one); a ticket
//! is one runner of one publish (an `Arc` of its job), so a burst costs no
//! allocation per queued runner. When a queue is full the overflow policy
//! applies: `Wait` (the default) has the publisher wait until the queue has
//! drained to half (only that queue's worker wakes it: each queue has its
//! own waiters), except on a pool worker, where it runs the job itself
//! as `CallerRuns` does (the room it would wait for may be its own); `Drop`
//! and `Error` count the deliveries as dropped.
//!
//! Stopping sets a flag and wakes every worker and every waiting publisher
//! (which then runs its job itself); a worker stops once every queue is
//! empty, so everything queued before still runs. `close` and dropping the
//! bus both stop the pool this way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batch::{Batch, Jobs};
use super::fanout::MAX_BATCH;
use super::pending::{self, Place};
use super::{caller_runs, refused, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::error::Error;
use crate::registry::entry::BoxFuture;
use crate::stats::Tally;
use crate::sync::channel::{self, Receiver, Sender, TrySendError};
use crate::sync::{
    thread, worker_mark, AtomicBool, AtomicUsize, Condvar, Mutex, MutexGuard, Ordering,
};
use crossbeam_utils::CachePadded;

/// How long a worker may start nothing new, with work queued behind it,
/// before an idle worker takes some of that work. Long enough that a burst
/// of cheap publishes (a batch of 64 takes well under a millisecond) stays
/// on its home worker; short enough that a handler that blocks holds up
/// the publishes queued behind it only briefly. Under loom time stands
/// still, and a worker counts as stalled once it has started nothing
/// between two looks.
#[cfg(not(loom))]
pub(crate) const STALL: Duration = Duration::from_millis(1);
#[cfg(loom)]
pub(crate) const STALL: Duration = Duration::ZERO;

pub(crate) enum Ticket<T> {
    /// A runner of a job, queued by the publisher, so no runner has seen
    /// the job yet.
    Run(Arc<Fanout<T>>),
    /// A helper joining a job a runner is on (its post; never queued).
    Help(Arc<Fanout<T>>),
    /// A worker joining the batch a stalled worker is running (never
    /// queued).
    Join(Arc<Batch<T>>),
    /// Look for work elsewhere, or stop if stopping and there is none.
    Wake,
}

/// What the pool's handle and its workers share.
struct Shared<T> {
    /// Work tickets a queue takes (its channel has room for two wake-ups
    /// more, so a wake-up never takes the place of work).
    capacity: usize,
    queues: Vec<Sender<Ticket<T>>>,
    tickets: Vec<Receiver<Ticket<T>>>,
    /// Per queue: wake-ups in it (or about to be). Admission counts work
    /// only: a wake-up can outlive its purpose (its worker found work by
    /// another way and runs it), and while that work runs the stale wake-up
    /// would otherwise take a one-ticket queue's only place.
    wakes: Vec<CachePadded<AtomicUsize>>,
    /// Per queue: tickets a worker took from it into a batch and has not run
    /// yet. They keep their room until then, so batching holds no more
    /// publishes than the queue would have. Counted before each is taken.
    held: Vec<CachePadded<AtomicUsize>>,
    /// Per worker: waiting on its own empty queue (or about to). Only the
    /// worker itself changes it. Other workers take nothing from a waiting
    /// worker's queue: it is about to take what is there itself.
    waiting: Vec<CachePadded<AtomicBool>>,
    /// Per worker: tickets it has taken so far. A worker whose count stands
    /// still for [`STALL`] while work is queued for it is stalled.
    started: Vec<CachePadded<AtomicUsize>>,
    /// Per worker: the work it is running that another worker could join
    /// (a batch, or a lone job that claims), for a worker that finds it
    /// stalled. Only the worker itself puts it in or takes it out.
    running: Vec<CachePadded<Mutex<Option<Joinable<T>>>>>,
    /// A job that wants another runner (units left, room for one more): a
    /// worker about to wait takes it instead. Posted by a runner's claim,
    /// taken by whoever looks first; a newer one replaces it (the older
    /// job's own runners still finish it).
    wanted: Mutex<Option<Arc<Fanout<T>>>>,
    /// Per worker: running nothing (looking for work, or waiting for it).
    /// True from the start: a worker not yet started takes what is queued
    /// for it as soon as it does. Only the worker itself changes it.
    free: Vec<CachePadded<AtomicBool>>,
    /// Workers waiting.
    idle: CachePadded<AtomicUsize>,
    /// Per queue: the publishers waiting for its room (`Overflow::Wait`).
    /// Only that queue's worker wakes them, once the queue is down to half:
    /// a publisher waiting for one queue is not woken by room freed in
    /// another (it would find a slot or two there and wait again, taking a
    /// core from a worker at each wake-up).
    room: Vec<CachePadded<RoomWait>>,
    /// Set when the bus starts closing: publishers wait no more (a handler
    /// blocked in `close` may be what they would wait for).
    no_waiting: AtomicBool,
    stopping: AtomicBool,
}

/// The publishers waiting for one queue's room, and what they wait on.
#[derive(Default)]
struct RoomWait {
    publishers_waiting: AtomicUsize,
    lock: Mutex<()>,
    freed: Condvar,
}

impl RoomWait {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Work a worker runs that another may join.
enum Joinable<T> {
    Job(Arc<Fanout<T>>),
    Batch(Arc<Batch<T>>),
}

impl<T> Joinable<T> {
    fn wants_help(&self) -> bool {
        match self {
            Joinable::Job(job) => job.wants_help(),
            Joinable::Batch(batch) => batch.wants_help(),
        }
    }

    /// The ticket that joins it.
    fn ticket(&self) -> Ticket<T> {
        match self {
            Joinable::Job(job) => Ticket::Help(Arc::clone(job)),
            Joinable::Batch(batch) => Ticket::Join(Arc::clone(batch)),
        }
    }
}

/// What a worker with an empty queue of its own found elsewhere.
enum Elsewhere<T> {
    /// A ticket, and the queue it came from.
    Took(Ticket<T>, usize),
    /// Work queued to a busy worker that is not stalled (yet).
    Watching,
    /// Nothing queued anywhere else.
    Nothing,
}

/// A worker's last look at each other worker: its started count then, and
/// when that count was first seen.
type Watch = Vec<Option<(usize, Instant)>>;

impl<T> Shared<T> {
    /// Takes a worker other than `busy` off the waiting list, if one waits:
    /// the caller wakes it. Taking it off first means one wake-up per wait,
    /// however many publishers see it waiting (wake-ups take queue room).
    fn take_waiting(&self, busy: usize) -> Option<usize> {
        if self.idle.load(Ordering::SeqCst) == 0 {
            return None;
        }
        // A compare-exchange, not a swap: the flag of a worker that is not
        // waiting is left as it is, so no store races that worker's own
        // announcement (loom orders racing stores by causality alone, and
        // then let a later swap read the flag as false after the worker had
        // set it: a lost wake-up C11 does not allow).
        (0..self.waiting.len()).find(|&worker| {
            worker != busy
                && self.waiting[worker]
                    .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
        })
    }

    fn lock_wanted(&self) -> MutexGuard<'_, Option<Arc<Fanout<T>>>> {
        self.wanted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts `job` as wanting a runner and wakes a waiting worker for it.
    /// Returns the job it replaced, for the caller to drop (a job holds a
    /// message, user data whose drop must not run under the lock).
    fn want_help(&self, job: &Arc<Fanout<T>>) -> Option<Arc<Fanout<T>>> {
        let replaced = self.lock_wanted().replace(Arc::clone(job));
        // After the post: a worker that set its waiting flag before this
        // load looks at the post after; one that did not is seen here.
        if let Some(worker) = self.take_waiting(usize::MAX) {
            self.wake(worker);
        }
        replaced
    }

    /// Queues a wake-up for `worker`; a full queue needs none (its worker
    /// has work to take).
    fn wake(&self, worker: usize) {
        // Counted before it is sent, so taking it never sees the count at
        // zero; meanwhile a publisher may admit one ticket more than the
        // capacity, which the channel's wake-up room holds.
        self.wakes[worker].fetch_add(1, Ordering::SeqCst);
        if self.queues[worker].try_send(Ticket::Wake).is_err() {
            self.wakes[worker].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Notes a ticket taken from `worker`'s queue: a wake-up is uncounted,
    /// and work taken frees room a publisher may wait for.
    fn took(&self, worker: usize, ticket: &Ticket<T>) {
        if matches!(ticket, Ticket::Wake) {
            self.wakes[worker].fetch_sub(1, Ordering::SeqCst);
        } else {
            self.freed(worker);
        }
    }

    /// Wakes the waiting publishers if `worker`'s queue is down to half.
    /// Room is freed before the count of waiters is read, and a publisher
    /// counts itself before it looks at the room (both `SeqCst`), so one of
    /// the two sees the other; the waker takes the lock the publisher holds
    /// from its look until it waits, so the wake-up cannot fall between.
    fn freed(&self, worker: usize) {
        let room = &self.room[worker];
        if room.publishers_waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let used = self.queued_work(worker) + self.held[worker].load(Ordering::SeqCst);
        if used <= self.capacity / 2 {
            let _lock = room.lock();
            room.freed.notify_all();
        }
    }

    /// Whether `worker`'s queue takes another work ticket.
    fn has_room(&self, worker: usize) -> bool {
        let wakes = self.wakes[worker].load(Ordering::SeqCst);
        let held = self.held[worker].load(Ordering::SeqCst);
        self.queues[worker].len().saturating_sub(wakes) + held < self.capacity
    }

    /// Work tickets queued for `worker`, never more than there are (a
    /// wake-up is counted before it is sent and uncounted after it is
    /// taken, so a count read meanwhile is at worst one short).
    fn queued_work(&self, worker: usize) -> usize {
        let wakes = self.wakes[worker].load(Ordering::SeqCst);
        self.queues[worker].len().saturating_sub(wakes)
    }

    /// Worker `me`, about to run what it took from its own queue, wakes a
    /// waiting worker if work is still queued behind it: the handler it
    /// runs may block, and a worker that looked at this queue while `me`
    /// was still waking up (or while a wake-up was being taken from it)
    /// skipped it. With [`Shared::stranded_work`], looked at after a worker
    /// announces its wait, one of the two always sees the other.
    ///
    /// The same holds for work `me` is about to run that another worker
    /// could join (`joinable`): a handler in it may block the rest.
    fn share_rest(&self, me: usize, joinable: bool) {
        if joinable || self.queued_work(me) > 0 {
            if let Some(helper) = self.take_waiting(me) {
                self.wake(helper);
            }
        }
    }

    /// Whether a queue other than `me`'s holds work, or its worker runs
    /// work with units left to claim, while that worker is not
    /// waiting (it is busy, perhaps in a slow handler): looked at by a
    /// worker after announcing its wait, which then watches it instead.
    fn stranded_work(&self, me: usize) -> bool {
        (0..self.queues.len()).any(|other| {
            other != me
                && !self.waiting[other].load(Ordering::SeqCst)
                && (self.queued_work(other) > 0 || self.runs_joinable(other))
        })
    }

    fn lock_running(&self, worker: usize) -> MutexGuard<'_, Option<Joinable<T>>> {
        self.running[worker]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Shows `work` as what `me` runs (`None`: nothing to join). Returns
    /// what it replaced, for the caller to drop after the lock (a job holds
    /// a message: user data, whose drop must not run under the lock).
    fn show_running(&self, me: usize, work: Option<Joinable<T>>) -> Option<Joinable<T>> {
        std::mem::replace(&mut *self.lock_running(me), work)
    }

    /// Whether `worker` runs work with units left to claim.
    fn runs_joinable(&self, worker: usize) -> bool {
        self.lock_running(worker)
            .as_ref()
            .is_some_and(Joinable::wants_help)
    }

    /// A ticket joining the work `worker` runs, if it has units left.
    fn joinable(&self, worker: usize) -> Option<Ticket<T>> {
        self.lock_running(worker)
            .as_ref()
            .filter(|work| work.wants_help())
            .map(Joinable::ticket)
    }

    /// Gives back the room of `tickets` held from `worker`'s queue.
    fn release(&self, worker: usize, tickets: usize) {
        if tickets > 0 {
            self.held[worker].fetch_sub(tickets, Ordering::SeqCst);
            self.freed(worker);
        }
    }

    /// The posted job, if it still wants a runner.
    fn take_wanted(&self) -> Option<Arc<Fanout<T>>> {
        let job = self.lock_wanted().take()?;
        if job.wants_help() {
            Some(job)
        } else {
            drop(job); // after the lock: see `want_help`
            None
        }
    }

    /// Queues `ticket` for `worker`; if that worker is busy (it may be
    /// stuck in a slow handler) and another waits, wakes the other to watch
    /// it.
    fn push(&self, worker: usize, ticket: Ticket<T>) -> Result<(), Ticket<T>> {
        if !self.has_room(worker) {
            return Err(ticket);
        }
        match self.queues[worker].try_send(ticket) {
            Ok(()) => {}
            Err(TrySendError::Full(ticket) | TrySendError::Disconnected(ticket)) => {
                return Err(ticket)
            }
        }
        if !self.waiting[worker].load(Ordering::SeqCst) {
            if let Some(helper) = self.take_waiting(worker) {
                self.wake(helper);
            }
        }
        Ok(())
    }

    /// Queues `ticket` for `worker`, waiting while its queue is full
    /// (`Overflow::Wait`). Gives the ticket back once the bus is closing.
    fn push_waiting(&self, worker: usize, mut ticket: Ticket<T>) -> Result<(), Ticket<T>> {
        loop {
            ticket = match self.push(worker, ticket) {
                Ok(()) => return Ok(()),
                Err(ticket) => ticket,
            };
            if self.no_waiting.load(Ordering::SeqCst) {
                return Err(ticket);
            }
            let room = &self.room[worker];
            let lock = room.lock();
            room.publishers_waiting.fetch_add(1, Ordering::SeqCst);
            let lock = if self.has_room(worker) || self.no_waiting.load(Ordering::SeqCst) {
                lock
            } else {
                room.freed.wait(lock).unwrap_or_else(|e| e.into_inner())
            };
            room.publishers_waiting.fetch_sub(1, Ordering::SeqCst);
            drop(lock);
        }
    }

    /// Whether `other` has started nothing for [`STALL`], by `watch`'s last
    /// looks (which this updates).
    fn stalled(&self, other: usize, watch: &mut Watch) -> bool {
        let started = self.started[other].load(Ordering::SeqCst);
        match watch[other] {
            Some((seen, since)) if seen == started => {
                crate::sync::now().duration_since(since) >= STALL
            }
            _ => {
                watch[other] = Some((started, crate::sync::now()));
                false
            }
        }
    }
}

impl<T> Shared<T> {
    fn new(workers: usize, per_worker: usize) -> Self {
        let (queues, tickets) = (0..workers)
            .map(|_| channel::bounded(per_worker + WAKE_ROOM))
            .unzip();
        let counters = || {
            (0..workers)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect()
        };
        let flags = |value: bool| {
            (0..workers)
                .map(|_| CachePadded::new(AtomicBool::new(value)))
                .collect()
        };
        Self {
            capacity: per_worker,
            queues,
            tickets,
            wakes: counters(),
            held: counters(),
            started: counters(),
            running: (0..workers)
                .map(|_| CachePadded::new(Mutex::new(None)))
                .collect(),
            waiting: flags(false),
            free: flags(true),
            wanted: Mutex::new(None),
            idle: CachePadded::new(AtomicUsize::new(0)),
            room: (0..workers).map(|_| CachePadded::default()).collect(),
            no_waiting: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        }
    }
}

/// Room each queue keeps beyond its work tickets, for wake-ups.
const WAKE_ROOM: usize = 2;

pub(crate) struct Pool<T> {
    shared: Arc<Shared<T>>,
    /// Turns for the units of `Batch::Single` below the threshold.
    turn: AtomicUsize,
}

impl<T: Send + Sync + 'static> Pool<T> {
    pub(crate) fn start(workers: usize, capacity: usize, env: &Arc<Env>) -> Result<Self, Error> {
        let per_worker = capacity.div_ceil(workers.max(1)).max(1);
        let pool = Self {
            shared: Arc::new(Shared::new(workers, per_worker)),
            turn: AtomicUsize::new(0),
        };
        for index in 0..workers {
            let shared = Arc::clone(&pool.shared);
            let env = Arc::clone(env);
            thread::Builder::new()
                .name(format!("blazesub-worker-{index}"))
                .spawn(move || work(index, &shared, &env))
                // Dropping `pool` stops the workers already started.
                .map_err(Error::Spawn)?;
        }
        Ok(pool)
    }

    /// Queues the job's runners; see the module docs for a full queue.
    pub(crate) fn dispatch(&self, job: Arc<Fanout<T>>, env: &Arc<Env>) -> usize {
        let plan = job.plan();
        let workers = self.shared.queues.len();
        // `Batch::Single` below the threshold: a unit per subscription,
        // spread over the workers. Everything else runs at the route's home.
        let spread = plan.single_claim && plan.runners > 1;
        let wait = env.overflow == Overflow::Wait && !worker_mark::is_set();
        let mut started = false;
        let mut dropped = 0;
        for _ in 0..plan.runners {
            let worker = if spread {
                self.turn.fetch_add(1, Ordering::Relaxed) % workers
            } else {
                job.home() % workers
            };
            let ticket = Ticket::Run(Arc::clone(&job));
            let queued = if wait {
                self.shared.push_waiting(worker, ticket)
            } else {
                self.shared.push(worker, ticket)
            };
            match queued {
                Ok(()) => started = true,
                Err(_) => match env.overflow {
                    Overflow::Wait | Overflow::CallerRuns => {
                        let mut runner = self.publisher_runner(&job, env);
                        caller_runs(&job, &mut runner, env);
                    }
                    Overflow::Drop | Overflow::Error => dropped += refused(&job, started, env),
                },
            }
        }
        dropped
    }

    fn publisher_runner<'a>(
        &'a self,
        job: &'a Arc<Fanout<T>>,
        env: &'a Arc<Env>,
    ) -> PoolRunner<'a, T> {
        PoolRunner {
            shared: &self.shared,
            job,
            env,
            place: Place::Publisher,
        }
    }
}

impl<T> Pool<T> {
    /// Publishers wait for room no more: from now on, one that meets a full
    /// queue runs its job itself, and those waiting do so now. Called when
    /// the bus starts closing: a handler blocked in `close` may be the one
    /// they wait for, and `close` waits for them. Idempotent.
    pub(crate) fn stop_waiting(&self) {
        if self.shared.no_waiting.swap(true, Ordering::SeqCst) {
            return;
        }
        for room in &self.shared.room {
            let _lock = room.lock();
            room.freed.notify_all();
        }
    }

    /// Lets the workers finish what is queued, then stop. Idempotent.
    pub(crate) fn shut_down(&self) {
        self.stop_waiting();
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        for worker in 0..self.shared.queues.len() {
            // A full queue's worker is not waiting: it sees the flag once
            // every queue is empty.
            self.shared.wake(worker);
        }
    }
}

impl<T> Drop for Pool<T> {
    fn drop(&mut self) {
        self.shut_down();
    }
}

fn work<T: Send + Sync + 'static>(me: usize, shared: &Arc<Shared<T>>, env: &Arc<Env>) {
    worker_mark::set();
    let mut watch: Watch = vec![None; shared.queues.len()];
    // A ticket taken while gathering a batch that did not fit it.
    let mut stash = None;
    // The last batch's allocation, for the next.
    let mut spare = None;
    while let Some((ticket, from)) = stash
        .take()
        .map(|ticket| (ticket, me))
        .or_else(|| next_ticket(me, shared, &mut watch))
    {
        let (job, whole) = match ticket {
            Ticket::Run(job) => {
                let whole = job.has_one_claiming_runner();
                (job, whole)
            }
            Ticket::Help(job) => (job, false),
            Ticket::Join(batch) => {
                run_batch(&batch, shared, env);
                continue;
            }
            Ticket::Wake => continue,
        };
        let jobs = if whole {
            gather_batch(me, from, shared, Arc::clone(&job), &mut stash)
        } else {
            Jobs::new()
        };
        if jobs.len() > 1 {
            let batch = batch_of(&mut spare, jobs);
            let shown = (job.total() > 1).then(|| Joinable::Batch(Arc::clone(&batch)));
            run_shown(me, shared, shown, || run_batch(&batch, shared, env));
            shared.release(from, batch.len() - 1);
            spare = Some(emptied(batch));
        } else {
            // A lone job claims, and enlists helpers while a worker is free;
            // one that turns free later joins it if it stalls.
            let shown =
                (whole && job.plan().max_runners > 1).then(|| Joinable::Job(Arc::clone(&job)));
            run_shown(me, shared, shown, || run_job(&job, shared, env));
        }
    }
}

/// Runs `run` on worker `me` with `shown` (work another worker may join)
/// in its slot meanwhile, after waking a waiting worker to watch it.
fn run_shown<T>(me: usize, shared: &Shared<T>, shown: Option<Joinable<T>>, run: impl FnOnce()) {
    let joinable = shown.is_some();
    if joinable {
        drop(shared.show_running(me, shown));
    }
    shared.share_rest(me, joinable);
    run();
    if joinable {
        drop(shared.show_running(me, None));
    }
}

/// Runs (or helps) `job` on a worker: it claims, and enlists helpers.
fn run_job<T: Send + Sync + 'static>(job: &Arc<Fanout<T>>, shared: &Shared<T>, env: &Arc<Env>) {
    let mut runner = PoolRunner {
        shared,
        job,
        env,
        place: Place::Worker,
    };
    let mut tally = Tally::default();
    job.run(env, &mut runner, &mut tally);
    env.counters.add(&tally);
}

/// Runs (or joins) `batch` on a worker.
fn run_batch<T: Send + Sync + 'static>(batch: &Batch<T>, shared: &Shared<T>, env: &Arc<Env>) {
    let Some(first) = batch.first() else {
        return;
    };
    // A batch's runners enlist no helpers: the job is only for that.
    let mut runner = PoolRunner {
        shared,
        job: first,
        env,
        place: Place::Worker,
    };
    let mut tally = Tally::default();
    batch.run(env, &mut runner, &mut tally);
    env.counters.add(&tally);
}

/// A batch of `jobs`, in `spare`'s allocation unless a worker that joined
/// it still holds it.
fn batch_of<T: Send + Sync + 'static>(
    spare: &mut Option<Arc<Batch<T>>>,
    jobs: Jobs<T>,
) -> Arc<Batch<T>> {
    if let Some(mut batch) = spare.take() {
        if let Some(reused) = Arc::get_mut(&mut batch) {
            reused.refill(jobs);
            return batch;
        }
    }
    Arc::new(Batch::of(jobs))
}

/// `batch` with its jobs dropped (their messages with them), unless a
/// worker that joined it still holds it: the last one to let go drops them.
fn emptied<T: Send + Sync + 'static>(mut batch: Arc<Batch<T>>) -> Arc<Batch<T>> {
    if let Some(own) = Arc::get_mut(&mut batch) {
        own.clear();
    }
    batch
}

/// The tickets queued right behind `job` on queue `from` (worker `me`'s
/// own, or the one it took `job` from) that are publishes to the same
/// subscriptions (a burst to one topic), up to [`MAX_BATCH`], after `job`:
/// run together, they walk the subscriptions once (see
/// [`Batch`]). The first ticket that does not fit is left in
/// `stash`. Only what is already queued is taken, so a lone publish runs as
/// soon as it comes.
///
/// A worker taking over from a stalled one takes a batch too, of at most
/// half of what that worker has left: one ticket at a time, it would walk
/// that worker's subscriptions a publish at a time beside it, and an
/// ordered subscription would take a runner's turn per message.
fn gather_batch<T: Send + Sync + 'static>(
    me: usize,
    from: usize,
    shared: &Shared<T>,
    job: Arc<Fanout<T>>,
    stash: &mut Option<Ticket<T>>,
) -> Jobs<T> {
    let mut jobs = Jobs::new();
    jobs.push(job);
    // A helper takes at most half of what is left, as work stealing does:
    // the owner, still at work on its own batch, runs the rest.
    let limit = if from == me {
        MAX_BATCH
    } else {
        1 + (shared.queues[from].len() / 2).min(MAX_BATCH - 1)
    };
    // Nothing queued behind (a lone publish): no room to hold and give back.
    while jobs.len() < limit && !shared.queues[from].is_empty() {
        // Held before it is taken, so the room is never counted twice.
        shared.held[from].fetch_add(1, Ordering::SeqCst);
        let taken = shared.tickets[from].try_recv();
        let fits = match &taken {
            Ok(Ticket::Run(next)) => next.has_one_claiming_runner() && jobs[0].same_chunks(next),
            _ => false,
        };
        if !fits {
            shared.release(from, 1);
        }
        match taken {
            Ok(Ticket::Run(next)) if fits => jobs.push(next),
            Ok(Ticket::Wake) => {
                shared.took(from, &Ticket::Wake);
                if from != me {
                    // Another worker's wake-up is its own (see
                    // `take_elsewhere`).
                    shared.wake(from);
                    break;
                }
                // A wake-up is no work, and this worker is awake.
            }
            Ok(other) => {
                *stash = Some(other);
                break;
            }
            Err(_) => break,
        }
    }
    let took_work = jobs.len() > 1 || stash.is_some();
    if from != me && took_work && shared.stopping.load(Ordering::SeqCst) {
        // As for the ticket itself (see `take_elsewhere`): a ticket left in
        // `stash` came from that queue too.
        shared.wake(from);
    }
    jobs
}

/// The next ticket for worker `me`: its own queue first, then a stalled
/// worker's; waits on its own when there is nothing to take. `None` once
/// stopping and all empty.
fn next_ticket<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Option<(Ticket<T>, usize)> {
    let ticket = look_for_ticket(me, shared, watch);
    // A wake-up is no work: the worker stays free through it.
    let work = matches!(
        ticket,
        Some((Ticket::Run(_) | Ticket::Help(_) | Ticket::Join(_), _))
    );
    if work {
        shared.started[me].fetch_add(1, Ordering::SeqCst);
        if shared.free[me].load(Ordering::Relaxed) {
            shared.free[me].store(false, Ordering::SeqCst);
        }
    }
    ticket
}

/// [`next_ticket`]'s search: the ticket, and the queue it came from.
fn look_for_ticket<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Option<(Ticket<T>, usize)> {
    loop {
        if let Some(found) = take_own(me, shared) {
            return Some(found);
        }
        match take_elsewhere(me, shared, watch) {
            Elsewhere::Took(ticket, from) => return Some((ticket, from)),
            Elsewhere::Watching => {
                if let Some(job) = shared.take_wanted() {
                    return Some((Ticket::Help(job), me));
                }
                if let Ok(ticket) = shared.tickets[me].recv_timeout(STALL) {
                    shared.took(me, &ticket);
                    return Some((ticket, me));
                }
                continue;
            }
            Elsewhere::Nothing => {}
        }
        if shared.stopping.load(Ordering::SeqCst) {
            return None;
        }
        shared.waiting[me].store(true, Ordering::SeqCst);
        shared.idle.fetch_add(1, Ordering::SeqCst);
        // Looked at after announcing the wait: see `Shared::share_rest`. A
        // worker that was waking up when this one passed its queue by, or
        // was taking a wake-up from it, may be in a slow handler now with
        // work queued behind it.
        if shared.stranded_work(me) {
            end_wait(me, shared);
            continue;
        }
        // Looked at after announcing the wait: see `Shared::want_help`.
        if let Some(job) = shared.take_wanted() {
            end_wait(me, shared);
            return Some((Ticket::Help(job), me));
        }
        // Disconnected (every handle gone): the caller looks again, and
        // stops once all is run.
        let ticket = match shared.tickets[me].recv() {
            Ok(ticket) => {
                shared.took(me, &ticket);
                ticket
            }
            Err(_) => Ticket::Wake,
        };
        end_wait(me, shared);
        return Some((ticket, me));
    }
}

/// A ticket from worker `me`'s own queue.
fn take_own<T: Send + Sync + 'static>(me: usize, shared: &Shared<T>) -> Option<(Ticket<T>, usize)> {
    if let Ok(ticket) = shared.tickets[me].try_recv() {
        shared.took(me, &ticket);
        return Some((ticket, me));
    }
    if !shared.free[me].load(Ordering::Relaxed) {
        shared.free[me].store(true, Ordering::SeqCst);
    }
    None
}

/// Work of another worker that is not waiting, in the batch it runs or
/// queued to it: joined or taken if that worker is stalled (or, for queued
/// work, the pool is stopping), else watched.
fn take_elsewhere<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Elsewhere<T> {
    let workers = shared.tickets.len();
    let stopping = shared.stopping.load(Ordering::SeqCst);
    let mut watching = false;
    for other in (1..workers).map(|offset| (me + offset) % workers) {
        let queued = shared.queued_work(other) > 0;
        if shared.waiting[other].load(Ordering::SeqCst) || !(queued || shared.runs_joinable(other))
        {
            // A waiting worker takes its own: what it was woken for must
            // still be there.
            watch[other] = None;
            continue;
        }
        if !stopping && !shared.stalled(other, watch) {
            watching = true;
            continue;
        }
        // What its running work has left is held up now; what is queued,
        // after it.
        if let Some(ticket) = shared.joinable(other) {
            return Elsewhere::Took(ticket, other);
        }
        if !queued {
            continue;
        }
        match shared.tickets[other].try_recv() {
            // Another worker's wake-up is its own: handed back, or that
            // worker could wait for ever.
            Ok(Ticket::Wake) => {
                shared.took(other, &Ticket::Wake);
                shared.wake(other);
            }
            Ok(ticket) => {
                shared.took(other, &ticket);
                watch[other] = None;
                if stopping {
                    // The stop's wake-up may have found this queue full
                    // with what was just taken: its worker must not wait
                    // on it for ever. (No one queues after the stop, so
                    // there is room.)
                    shared.wake(other);
                }
                return Elsewhere::Took(ticket, other);
            }
            Err(_) => {}
        }
    }
    if watching {
        Elsewhere::Watching
    } else {
        Elsewhere::Nothing
    }
}

/// Worker `me` no longer waits (woken, or it found work after announcing).
fn end_wait<T>(me: usize, shared: &Shared<T>) {
    shared.idle.fetch_sub(1, Ordering::SeqCst);
    shared.waiting[me].store(false, Ordering::SeqCst);
}

/// A runner on a worker thread, or on a publisher the queue had no room for.
struct PoolRunner<'a, T> {
    shared: &'a Shared<T>,
    job: &'a Arc<Fanout<T>>,
    env: &'a Arc<Env>,
    place: Place,
}

impl<T: Send + Sync + 'static> Runner<T> for PoolRunner<'_, T> {
    fn has_idle_capacity(&self) -> bool {
        self.shared
            .free
            .iter()
            .any(|free| free.load(Ordering::Relaxed))
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        // Posted, not queued: the next worker about to wait takes it, so a
        // worker that turns free later still helps.
        let replaced = self.shared.want_help(self.job);
        drop(replaced);
        true
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        pending::settle(delivery, self.env, self.place, tally);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::{Config, DeliveryMode};
    use crate::dispatch::Policy;
    use crate::message::Message;
    use crate::registry::entry::{HandlerEntry, Subscriber, SyncSink};
    use crate::registry::route::RouteCache;
    use crate::registry::trie::{Handlers, Trie};

    /// Publishes to `handlers` no-op handlers on one topic, cut into chunks.
    fn chunked_jobs(handlers: u64, publishes: u32) -> Vec<Arc<Fanout<u32>>> {
        let jobs = jobs_on("t", handlers, publishes, 10);
        assert!(
            jobs.iter().all(|job| job.plan().unit > 1),
            "cut into chunks"
        );
        jobs
    }

    /// Publishes to `handlers` no-op handlers on `topic` under `threshold`.
    fn jobs_on(
        topic: &str,
        handlers: u64,
        publishes: u32,
        threshold: usize,
    ) -> Vec<Arc<Fanout<u32>>> {
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            workers: 2,
            max_concurrent_subscriptions: threshold,
            ..Config::default()
        };
        let trie = Trie::<u32>::new();
        for id in 0..handlers {
            let entry: HandlerEntry<u32> =
                Arc::new(Subscriber::new(id, SyncSink(|_: &Message<u32>| {})));
            assert!(trie.insert::<Handlers>(topic, |_| entry).is_ok());
        }
        let cache = RouteCache::<u32>::new(2);
        (0..publishes)
            .map(|n| {
                let sets = cache.route(&trie, topic).handler_sets();
                let job = Fanout::new(
                    Arc::new(Message::new(topic, n)),
                    sets,
                    Default::default(),
                    &Policy::new(&config),
                )
                .unwrap();
                Arc::new(job)
            })
            .collect()
    }

    /// Below the threshold, publishes queued behind one another to the same
    /// subscriptions run as one batch, as chunks do above it: one runner
    /// each, claiming subscription by subscription, walked the entries once
    /// per publish, and the bench's service setting saw the threshold's two
    /// sides 1.3-1.4x apart.
    #[test]
    fn a_worker_takes_whole_jobs_below_the_threshold_as_one_batch() {
        let shared = Shared::<u32>::new(2, 16);
        let same = jobs_on("t", 100, 4, 1_000);
        assert!(same.iter().all(|job| job.has_one_claiming_runner()));
        let other = jobs_on("u", 100, 1, 1_000);
        for job in same.iter().chain(&other) {
            assert!(shared.push(0, Ticket::Run(Arc::clone(job))).is_ok());
        }
        let Some((Ticket::Run(job), from)) = look_for_ticket(0, &shared, &mut vec![None; 2]) else {
            panic!("worker 0 takes its own job");
        };
        let mut stash = None;
        let jobs = gather_batch(0, from, &shared, job, &mut stash);
        assert_eq!(
            jobs.len(),
            4,
            "the job and the three publishes behind it to the same route"
        );
        assert!(jobs.iter().zip(&same).all(|(a, b)| Arc::ptr_eq(a, b)));
        assert!(
            matches!(&stash, Some(Ticket::Run(job)) if Arc::ptr_eq(job, &other[0])),
            "another route's job is left to run next"
        );
        assert!(shared.queues[0].is_empty());
        assert_eq!(
            shared.held[0].load(Ordering::SeqCst),
            3,
            "the batch keeps its room in the queue until it has run"
        );
        shared.release(0, jobs.len() - 1);
        assert_eq!(shared.held[0].load(Ordering::SeqCst), 0);
    }

    /// A worker with nothing of its own leaves a busy worker's queue alone
    /// while that worker keeps starting work: two workers on one topic's
    /// burst put its handlers on two cores, and handlers that share state
    /// ran 3-4x slower there than on one.
    #[test]
    fn an_idle_worker_takes_nothing_from_a_worker_that_keeps_starting_work() {
        let shared = Shared::<u32>::new(2, 16);
        for job in chunked_jobs(100, 7) {
            assert!(shared.push(1, Ticket::Run(job)).is_ok());
        }
        let mut watch = vec![None; 2];
        for _ in 0..3 {
            assert!(matches!(
                take_elsewhere(0, &shared, &mut watch),
                Elsewhere::Watching
            ));
            std::thread::sleep(STALL * 2);
            // Worker 1 started another ticket meanwhile.
            shared.started[1].fetch_add(1, Ordering::SeqCst);
        }
        assert_eq!(shared.queued_work(1), 7, "nothing taken");
    }

    /// A worker with nothing of its own takes a batch from a stalled one
    /// (it started nothing for `STALL`), as the owner would: at most half
    /// of what is left, so the owner keeps the rest. One ticket at a time,
    /// it walked the owner's subscriptions a publish at a time beside it
    /// (an ordered subscription then took a runner's turn per message).
    #[test]
    fn an_idle_worker_takes_half_of_a_stalled_workers_queue_as_one_batch() {
        let shared = Shared::<u32>::new(2, 16);
        for job in chunked_jobs(100, 7) {
            assert!(shared.push(1, Ticket::Run(job)).is_ok());
        }
        let Some((Ticket::Run(job), from)) = look_for_ticket(0, &shared, &mut vec![None; 2]) else {
            panic!("worker 0 takes worker 1's job once worker 1 stalls");
        };
        assert_eq!(from, 1);
        let mut stash = None;
        let jobs = gather_batch(0, from, &shared, job, &mut stash);
        assert_eq!(jobs.len(), 4, "the job and half of the 6 left");
        assert!(stash.is_none());
        assert_eq!(shared.queues[1].len(), 3, "the owner keeps the rest");
        // The owner gathers what is left of its own queue.
        let Some((Ticket::Run(job), from)) = look_for_ticket(1, &shared, &mut vec![None; 2]) else {
            panic!("worker 1 takes its own job");
        };
        assert_eq!(from, 1);
        let jobs = gather_batch(1, from, &shared, job, &mut stash);
        assert_eq!(jobs.len(), 3);
        assert!(shared.queues[1].is_empty());
    }

    #[test]
    fn a_stale_wake_up_takes_no_place_of_work() {
        let shared = Shared::<u32>::new(2, 1);
        // Worker 0 was woken, then found work another way and runs it: its
        // wake-up stays queued meanwhile.
        shared.wake(0);
        assert!(
            shared.has_room(0),
            "a one-ticket queue holding only a wake-up has room"
        );
        assert_eq!(shared.queues[0].len(), 1);
        let ticket = shared.tickets[0].try_recv().unwrap();
        shared.took(0, &ticket);
        assert_eq!(shared.wakes[0].load(Ordering::SeqCst), 0);
        assert!(shared.has_room(0));
    }
}
