//! `DeliveryMode::WorkerPool`: runners are jobs on bounded queues served by
//! a fixed set of threads, one queue per worker.
//!
//! # Where work goes
//! - A job cut into chunks (above the threshold under `Batch::Chunked`)
//!   queues chunk `c` to worker `c % workers`, every publish. So a given
//!   subscription's deliveries run on the same worker publish after publish,
//!   and whatever its handler touches stays in that worker's core cache. A
//!   shared queue let any worker take any chunk; handlers that keep state of
//!   their own then moved it between the cores on most deliveries, which
//!   made two workers slower than one (see `docs/design-notes.md`, "Where a
//!   subscription runs").
//! - A worker that takes a chunk ticket also takes the same chunk of the
//!   publishes queued right behind it on its own queue, up to
//!   [`MAX_BATCH`] while they reach the same subscriptions (a burst to one
//!   topic), and runs them subscription by subscription
//!   ([`Fanout::run_chunk_batch`]): the entries are walked once per batch,
//!   and an ordered subscription takes its messages of the batch in one
//!   turn as its runner instead of one turn each. Only what is already
//!   queued is batched, so a lone publish waits for nothing.
//! - Other runners (below the threshold, or `Batch::Single`) go to the
//!   queues in turn. Below the threshold under `Batch::Chunked` a job has
//!   one runner, and a worker that takes one also takes the jobs queued
//!   right behind it to the same subscriptions, and runs them whole as one
//!   batch the same way ([`Part::Whole`]): under a burst both workers are
//!   busy and no helper would come, and one publish at a time made the two
//!   sides of the threshold 1.3-1.4x apart. A lone job claims its units and
//!   enlists helpers as before.
//! - A runner that wants a helper (units left, room for one more runner)
//!   *posts* its job rather than queuing a ticket for a guessed idle
//!   worker: every worker looks at the post after announcing that it is
//!   about to wait, and the runner wakes a waiting worker after posting, so
//!   a worker that turns free at any moment joins in.
//! - A worker whose own queue is empty takes tickets from the others' before
//!   it waits, so a slow handler holds up only the worker it is on (and the
//!   rest of the batch it runs) while another has nothing to do. It takes
//!   a ticket with the same part of the publishes queued behind it there,
//!   as a batch of at most half of what that queue holds (work stealing's
//!   rule: the owner keeps the rest). It waits on its own queue only; a
//!   publisher that queues for a busy worker while another waits wakes that
//!   one to help. Under a burst no worker waits, so each runs its own
//!   chunks.
//! - No work is left queued behind a busy worker while another waits. A
//!   worker skips a queue whose worker is waiting (or still waking up), and
//!   hands back a wake-up it finds there; so after announcing its wait it
//!   looks once more for work queued to a worker that is not waiting, and
//!   takes it instead of waiting. A worker about to run what it took from
//!   its own queue, with more queued behind it, wakes a waiting one. The
//!   two sides store before they load, so one of them always sees the
//!   other (`loom_tests.rs` checks both with a handler that blocks until
//!   the others have run).
//!
//! A queue holds `queue_capacity / workers` tickets (at least one); a ticket
//! is one runner of one publish (an `Arc` of its job), so a burst costs no
//! allocation per queued runner. When a queue is full the overflow policy
//! applies: `CallerRuns` runs the runner on the publisher's thread, `Drop`
//! and `Error` count its deliveries as dropped.
//!
//! Stopping sets a flag and wakes every worker; a worker stops once every
//! queue is empty, so everything queued before still runs. `close` and
//! dropping the bus both stop the pool this way.

use std::sync::Arc;

use super::fanout::{Part, MAX_BATCH};
use super::pending::{self, Place};
use super::{caller_runs, refused, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::error::Error;
use crate::registry::entry::BoxFuture;
use crate::stats::Tally;
use crate::sync::channel::{self, Receiver, Sender, TrySendError};
use crate::sync::{thread, AtomicBool, AtomicUsize, Mutex, MutexGuard, Ordering};
use crossbeam_utils::CachePadded;
use smallvec::SmallVec;

pub(crate) enum Ticket<T> {
    /// A runner claiming from the job's shared cursor; queued by the
    /// publisher, so no runner has seen the job yet.
    Run(Arc<Fanout<T>>),
    /// A helper joining a job a runner is on (its post; never queued).
    Help(Arc<Fanout<T>>),
    /// Chunk `c` of a job, and nothing else of it.
    Chunk(Arc<Fanout<T>>, usize),
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
    stopping: AtomicBool,
}

impl<T> Shared<T> {
    /// Takes a worker other than `busy` off the waiting list, if one waits:
    /// the caller wakes it. Taking it off first means one wake-up per wait,
    /// however many publishers see it waiting (wake-ups take queue room).
    fn take_waiting(&self, busy: usize) -> Option<usize> {
        if self.idle.load(Ordering::SeqCst) == 0 {
            return None;
        }
        (0..self.waiting.len())
            .find(|&worker| worker != busy && self.waiting[worker].swap(false, Ordering::SeqCst))
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

    /// Notes a ticket taken from `worker`'s queue.
    fn took(&self, worker: usize, ticket: &Ticket<T>) {
        if matches!(ticket, Ticket::Wake) {
            self.wakes[worker].fetch_sub(1, Ordering::SeqCst);
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
    /// runs may be slow, and a worker that looked at this queue while `me`
    /// was still waking up (or while a wake-up was being taken from it)
    /// skipped it. With [`Shared::stranded_work`], looked at after a worker
    /// announces its wait, one of the two always sees the other.
    fn share_rest(&self, me: usize) {
        if self.queued_work(me) > 0 {
            if let Some(helper) = self.take_waiting(me) {
                self.wake(helper);
            }
        }
    }

    /// Whether a queue other than `me`'s holds work while its worker is not
    /// waiting (it is busy, perhaps in a slow handler): looked at by a
    /// worker after announcing its wait, which then takes it instead.
    fn stranded_work(&self, me: usize) -> bool {
        (0..self.queues.len()).any(|other| {
            other != me
                && !self.waiting[other].load(Ordering::SeqCst)
                && self.queued_work(other) > 0
        })
    }

    /// Gives back the room of `tickets` held from `worker`'s queue.
    fn release(&self, worker: usize, tickets: usize) {
        if tickets > 0 {
            self.held[worker].fetch_sub(tickets, Ordering::SeqCst);
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
    /// stuck in a slow handler) and another waits, wakes the other to help.
    fn push(&self, worker: usize, ticket: Ticket<T>) -> Result<(), TrySendError<Ticket<T>>> {
        if !self.has_room(worker) {
            return Err(TrySendError::Full(ticket));
        }
        self.queues[worker].try_send(ticket)?;
        if !self.waiting[worker].load(Ordering::SeqCst) {
            if let Some(helper) = self.take_waiting(worker) {
                self.wake(helper);
            }
        }
        Ok(())
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
            waiting: flags(false),
            free: flags(true),
            wanted: Mutex::new(None),
            idle: CachePadded::new(AtomicUsize::new(0)),
            stopping: AtomicBool::new(false),
        }
    }
}

/// Room each queue keeps beyond its work tickets, for wake-ups.
const WAKE_ROOM: usize = 2;

pub(crate) struct Pool<T> {
    shared: Arc<Shared<T>>,
    /// Turns for runners that have no chunk of their own.
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
        if plan.unit > 1 && !plan.single_claim {
            let mut dropped = 0;
            for chunk in 0..job.total().div_ceil(plan.unit) {
                let ticket = Ticket::Chunk(Arc::clone(&job), chunk);
                if self.shared.push(chunk % workers, ticket).is_err() {
                    dropped += self.refused_chunk(&job, chunk, env);
                }
            }
            return dropped;
        }
        let mut started = false;
        let mut dropped = 0;
        for _ in 0..plan.runners {
            let worker = self.turn.fetch_add(1, Ordering::Relaxed) % workers;
            match self.shared.push(worker, Ticket::Run(Arc::clone(&job))) {
                Ok(()) => started = true,
                Err(_) => match env.overflow {
                    Overflow::CallerRuns => {
                        let mut runner = self.publisher_runner(&job, env);
                        caller_runs(&job, &mut runner, env);
                    }
                    Overflow::Drop | Overflow::Error => dropped += refused(&job, started, env),
                },
            }
        }
        dropped
    }

    /// A chunk its worker's queue had no room for: run here or dropped.
    fn refused_chunk(&self, job: &Arc<Fanout<T>>, chunk: usize, env: &Arc<Env>) -> usize {
        let mut tally = Tally::default();
        let dropped = match env.overflow {
            Overflow::CallerRuns => {
                env.counters.caller_ran();
                let mut runner = self.publisher_runner(job, env);
                job.run_chunk(env, &mut runner, &mut tally, chunk);
                0
            }
            Overflow::Drop | Overflow::Error => job.drop_chunk(chunk, &mut tally),
        };
        env.counters.add(&tally);
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
    /// Lets the workers finish what is queued, then stop. Idempotent.
    pub(crate) fn shut_down(&self) {
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
    // A ticket taken while gathering a batch that did not fit it.
    let mut stash = None;
    while let Some((ticket, from)) = stash
        .take()
        .map(|ticket| (ticket, me))
        .or_else(|| next_ticket(me, shared))
    {
        let (job, part) = match ticket {
            Ticket::Run(job) if job.has_one_claiming_runner() => (job, Some(Part::Whole)),
            Ticket::Run(job) | Ticket::Help(job) => (job, None),
            Ticket::Chunk(job, chunk) => (job, Some(Part::Chunk(chunk))),
            Ticket::Wake => continue,
        };
        let mut runner = PoolRunner {
            shared,
            job: &job,
            env,
            place: Place::Worker,
        };
        let mut tally = Tally::default();
        let more = part.map_or_else(SmallVec::new, |part| {
            gather_batch(me, from, shared, &job, part, &mut stash)
        });
        if from == me {
            shared.share_rest(me);
        }
        match part {
            Some(part) if !more.is_empty() => {
                let mut batch = SmallVec::<[Arc<Fanout<T>>; MAX_BATCH]>::new();
                batch.push(Arc::clone(&job));
                batch.extend(more);
                Fanout::run_chunk_batch(&batch, env, &mut runner, &mut tally, part);
                shared.release(from, batch.len() - 1);
            }
            Some(Part::Chunk(chunk)) => job.run_chunk(env, &mut runner, &mut tally, chunk),
            // A lone job below the threshold claims, and enlists helpers.
            Some(Part::Whole) | None => job.run(env, &mut runner, &mut tally),
        }
        env.counters.add(&tally);
    }
}

/// The tickets queued right behind `part` of `job` on queue `from` (worker
/// `me`'s own, or the one it took `job` from) that are the same part of
/// publishes with the same chunks (a burst to one topic), up to
/// [`MAX_BATCH`] with `job`: run together, they walk the subscriptions once
/// (see [`Fanout::run_chunk_batch`]). The first ticket that does not fit is
/// left in `stash`. Only what is already queued is taken, so a lone publish
/// runs as soon as it comes, as before.
///
/// A worker helping another takes a batch too, of at most half of what that
/// worker has left: one ticket at a time, it would walk that worker's
/// subscriptions a publish at a time beside it, and an ordered subscription
/// would take a runner's turn per message.
fn gather_batch<T: Send + Sync + 'static>(
    me: usize,
    from: usize,
    shared: &Shared<T>,
    job: &Fanout<T>,
    part: Part,
    stash: &mut Option<Ticket<T>>,
) -> SmallVec<[Arc<Fanout<T>>; MAX_BATCH]> {
    let mut more = SmallVec::new();
    // A helper takes at most half of what is left, as work stealing does:
    // the owner, still at work on its own batch, runs the rest.
    let limit = if from == me {
        MAX_BATCH - 1
    } else {
        (shared.queues[from].len() / 2).min(MAX_BATCH - 1)
    };
    // Nothing queued behind (a lone publish): no room to hold and give back.
    while more.len() < limit && !shared.queues[from].is_empty() {
        // Held before it is taken, so the room is never counted twice.
        shared.held[from].fetch_add(1, Ordering::SeqCst);
        let taken = shared.tickets[from].try_recv();
        let fits = match &taken {
            Ok(Ticket::Chunk(next, c)) => part == Part::Chunk(*c) && job.same_chunks(next),
            Ok(Ticket::Run(next)) => {
                part == Part::Whole && next.has_one_claiming_runner() && job.same_chunks(next)
            }
            _ => false,
        };
        if !fits {
            shared.release(from, 1);
        }
        match taken {
            Ok(Ticket::Chunk(next, _) | Ticket::Run(next)) if fits => more.push(next),
            Ok(Ticket::Wake) => {
                shared.took(from, &Ticket::Wake);
                if from != me {
                    // Another worker's wake-up is its own (see
                    // `look_for_ticket`).
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
    let took_work = !more.is_empty() || stash.is_some();
    if from != me && took_work && shared.stopping.load(Ordering::SeqCst) {
        // As for the ticket itself (see `look_for_ticket`): a ticket left in
        // `stash` came from that queue too.
        shared.wake(from);
    }
    more
}

/// The next ticket for worker `me`: its own queue first, then the others';
/// waits on its own when all are empty. `None` once stopping and all empty.
fn next_ticket<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
) -> Option<(Ticket<T>, usize)> {
    let ticket = look_for_ticket(me, shared);
    // A wake-up is no work: the worker stays free through it.
    let work = matches!(
        ticket,
        Some((Ticket::Run(_) | Ticket::Help(_) | Ticket::Chunk(..), _))
    );
    if work && shared.free[me].load(Ordering::Relaxed) {
        shared.free[me].store(false, Ordering::SeqCst);
    }
    ticket
}

/// [`next_ticket`]'s search: the ticket, and the queue it came from.
fn look_for_ticket<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
) -> Option<(Ticket<T>, usize)> {
    loop {
        if let Some(found) = take_queued(me, shared) {
            return Some(found);
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

/// A ticket already queued: from worker `me`'s own queue, else from
/// another's whose worker is not waiting.
fn take_queued<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
) -> Option<(Ticket<T>, usize)> {
    let workers = shared.tickets.len();
    if let Ok(ticket) = shared.tickets[me].try_recv() {
        shared.took(me, &ticket);
        return Some((ticket, me));
    }
    if !shared.free[me].load(Ordering::Relaxed) {
        shared.free[me].store(true, Ordering::SeqCst);
    }
    for other in (1..workers).map(|offset| (me + offset) % workers) {
        if shared.waiting[other].load(Ordering::SeqCst) {
            // It takes its own: what it was woken for must still be there.
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
                if shared.stopping.load(Ordering::SeqCst) {
                    // The stop's wake-up may have found this queue full
                    // with what was just taken: its worker must not wait
                    // on it for ever. (No one queues after the stop, so
                    // there is room.)
                    shared.wake(other);
                }
                return Some((ticket, other));
            }
            Err(_) => {}
        }
    }
    None
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
        let Some((Ticket::Run(job), from)) = look_for_ticket(0, &shared) else {
            panic!("worker 0 takes its own job");
        };
        let mut stash = None;
        let more = gather_batch(0, from, &shared, &job, Part::Whole, &mut stash);
        assert_eq!(
            more.len(),
            3,
            "the three publishes behind it to the same route"
        );
        assert!(more.iter().zip(&same[1..]).all(|(a, b)| Arc::ptr_eq(a, b)));
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
        shared.release(0, more.len());
        assert_eq!(shared.held[0].load(Ordering::SeqCst), 0);
    }

    /// A worker with nothing of its own takes a batch from a busy one, as
    /// the owner would: at most half of what is left, so the owner keeps
    /// the rest. One ticket at a time, it walked the owner's subscriptions
    /// a publish at a time beside it (an ordered subscription then took a
    /// runner's turn per message).
    #[test]
    fn a_helper_takes_half_of_a_busy_workers_queue_as_one_batch() {
        let shared = Shared::<u32>::new(2, 16);
        for job in chunked_jobs(100, 7) {
            assert!(shared.push(1, Ticket::Chunk(job, 1)).is_ok());
        }
        let Some((Ticket::Chunk(job, chunk), from)) = look_for_ticket(0, &shared) else {
            panic!("worker 0 takes worker 1's chunk");
        };
        assert_eq!((from, chunk), (1, 1));
        let mut stash = None;
        let more = gather_batch(0, from, &shared, &job, Part::Chunk(chunk), &mut stash);
        assert_eq!(more.len(), 3, "half of the 6 left");
        assert!(stash.is_none());
        assert_eq!(shared.queues[1].len(), 3, "the owner keeps the rest");
        // The owner gathers what is left of its own queue.
        let Some((Ticket::Chunk(job, chunk), from)) = look_for_ticket(1, &shared) else {
            panic!("worker 1 takes its own chunk");
        };
        assert_eq!(from, 1);
        let more = gather_batch(1, from, &shared, &job, Part::Chunk(chunk), &mut stash);
        assert_eq!(more.len(), 2);
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
