//! A pool worker's loop: where it finds its next ticket (its `next`, its
//! own queue, then a stalled worker's running work, `next` or queue, then
//! the posted job, then it waits), and how it runs what it took (a batch of
//! the publishes queued behind one another, or a lone job that claims).
//! Also the stand-in that a `close` waiting from inside a handler runs.
//!
//! # Contract
//! - A worker (or the stand-in) takes from another only what that worker
//!   is held up on: work it has started nothing new of for [`STALL`],
//!   joined or taken at most half at a time (the owner keeps the rest); or
//!   anything once the pool is stopping.
//! - A worker about to wait looks once more for stranded work and for the
//!   posted job after announcing its wait (see `shared.rs`).
//! - A worker stops only once stopping and every queue is empty, so
//!   everything queued before the stop runs.

use std::sync::Arc;

use super::cores::Seat;
use super::shared::{Joinable, Shared, Ticket, Watch};
use super::{PoolRunner, STALL};
use crate::dispatch::batch::{Batch, Jobs};
use crate::dispatch::fanout::MAX_BATCH;
use crate::dispatch::pending::Place;
use crate::dispatch::{Env, Fanout};
use crate::stats::Tally;
use crate::sync::{worker_mark, Ordering};

/// What a worker with an empty queue of its own found elsewhere.
pub(super) enum Elsewhere<T> {
    /// A ticket, and the queue it came from.
    Took(Ticket<T>, usize),
    /// Work queued to a busy worker that is not stalled (yet).
    Watching,
    /// Nothing queued anywhere else.
    Nothing,
}

pub(super) fn work<T: Send + Sync + 'static>(me: usize, shared: &Arc<Shared<T>>, env: &Arc<Env>) {
    worker_mark::set(shared.key(), me);
    let mut watch: Watch = vec![None; shared.queues.len()];
    // A ticket taken while gathering a batch that did not fit it, until it
    // goes to `next` (see `Shared::next`).
    let mut stash = None;
    // The last batch's allocation, for the next.
    let mut spare = None;
    let mut seat = Seat::new();
    while let Some((ticket, from)) = next_ticket(me, shared, &mut watch) {
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
        if let Some(ticket) = stash.take() {
            shared.put_next(me, ticket);
        }
        if jobs.len() > 1 {
            if shared.runs_own[me].load(Ordering::Relaxed) {
                shared.cores.look(me, &mut seat, |worker| {
                    shared.runs_own[worker].load(Ordering::Relaxed)
                });
            }
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
pub(super) fn gather_batch<T: Send + Sync + 'static>(
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

/// The next ticket for worker `me`: its `next`, its own queue, then a
/// stalled worker's; waits on its own when there is nothing to take.
/// `None` once stopping and all empty.
fn next_ticket<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Option<(Ticket<T>, usize)> {
    let ticket = shared
        .take_next(me)
        .map(|ticket| (ticket, me))
        .or_else(|| look_for_ticket(me, shared, watch));
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
    // Helping (a posted job, a stalled worker's batch) is no work of its
    // own, even when the ticket is counted to its own queue.
    let own = matches!(ticket, Some((Ticket::Run(_), from)) if from == me);
    if shared.runs_own[me].load(Ordering::Relaxed) != own {
        shared.runs_own[me].store(own, Ordering::Relaxed);
    }
    ticket
}

/// [`next_ticket`]'s search: the ticket, and the queue it came from.
pub(super) fn look_for_ticket<T: Send + Sync + 'static>(
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
    // Nothing of its own left, whatever it helps with or waits for next.
    if shared.runs_own[me].load(Ordering::Relaxed) {
        shared.runs_own[me].store(false, Ordering::Relaxed);
    }
    None
}

/// Work of another worker that is not waiting, in the batch it runs, in
/// its `next` or queued to it: joined or taken if that worker is stalled
/// (or, for queued work, the pool is stopping), else watched.
pub(super) fn take_elsewhere<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Elsewhere<T> {
    let workers = shared.tickets.len();
    take_from(
        (1..workers).map(|offset| (me + offset) % workers),
        shared,
        watch,
    )
}

/// [`take_elsewhere`] from the workers `others`.
fn take_from<T: Send + Sync + 'static>(
    others: impl Iterator<Item = usize>,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Elsewhere<T> {
    let stopping = shared.stopping.load(Ordering::SeqCst);
    let mut watching = false;
    for other in others {
        let queued = shared.queued_work(other) > 0;
        let next = shared.has_next(other);
        if shared.waiting[other].load(Ordering::SeqCst)
            || !(queued || next || shared.runs_joinable(other))
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
        if let Some(ticket) = next.then(|| shared.take_next(other)).flatten() {
            watch[other] = None;
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

/// Runs, on a thread that is no worker (a `close` waiting from inside a
/// handler, which may hold up a worker: in a pool of one, the only one),
/// one piece of work a stalled worker is held up on, as a worker with
/// nothing of its own would take it (see [`take_elsewhere`]): what that
/// worker runs and another may join, its `next`, or its queue's head, run
/// alone. Returns whether it ran any.
pub(super) fn stand_in<T: Send + Sync + 'static>(
    shared: &Shared<T>,
    env: &Arc<Env>,
    watch: &mut Watch,
) -> bool {
    let before = watch.clone();
    let Elsewhere::Took(ticket, from) = take_from(0..shared.queues.len(), shared, watch) else {
        return false;
    };
    // The worker it took from is still held up (its started count has not
    // moved): keep watching it from then, not anew, or every ticket taken
    // costs another `STALL` and a burst queued behind the caller drains at
    // one ticket a millisecond.
    watch[from] = before[from];
    match ticket {
        Ticket::Run(job) | Ticket::Help(job) => run_job(&job, shared, env),
        Ticket::Join(batch) => run_batch(&batch, shared, env),
        Ticket::Wake => {}
    }
    true
}

/// Worker `me` no longer waits (woken, or it found work after announcing).
fn end_wait<T>(me: usize, shared: &Shared<T>) {
    shared.idle.fetch_sub(1, Ordering::SeqCst);
    shared.waiting[me].store(false, Ordering::SeqCst);
}
