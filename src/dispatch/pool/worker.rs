//! A pool worker's loop: it serves its own lane (taking, as a lane's task
//! does, the publishes queued behind one another as one batch), then looks
//! for a stalled worker's running work or lane, then for the posted job,
//! then waits for its bell. Also the stand-in that a `close` waiting from
//! inside a handler runs.
//!
//! # Contract
//! - A worker (or the stand-in) takes from another only what that worker
//!   is held up on: work it has started nothing new of for [`STALL`],
//!   joined, or taken at most half of its lane at a time (the owner keeps
//!   the rest); or anything once the pool is stopping.
//! - A worker about to wait looks once more for stranded work and for the
//!   posted job after announcing its wait (see `shared.rs`); its own lane
//!   rings its bell. A worker that runs work found elsewhere first wakes a
//!   waiting worker if its own lane holds work ([`take_found`]).
//! - A worker stops once stopping, with nothing queued in its lane and no
//!   share of it out, and nothing to take elsewhere. `close` stops the
//!   pool only once everything accepted has run, and a worker runs its own
//!   lane before it looks at stopping, so nothing queued before the stop
//!   is left.

use std::sync::Arc;

use super::cores::Seat;
use super::shared::{Elsewhere, Found, Joinable, Shared, Watch};
use super::{PoolRunner, STALL};
use crate::dispatch::batch::{Batch, Jobs};
use crate::dispatch::lane::{Next, Server, Work};
use crate::dispatch::pending::Place;
use crate::dispatch::{Env, Fanout};
use crate::stats::Tally;
use crate::sync::{worker_mark, Ordering};

/// What a worker does next.
#[allow(clippy::large_enum_variant)] // see `Found`
enum Step<T> {
    /// Serve its own lane.
    Own,
    /// Run what it found elsewhere.
    Found(Found<T>),
    /// Stop: the pool is stopping and nothing is left.
    Stop,
}

/// What a worker keeps from one piece of work to the next.
struct Keep<T> {
    /// The last batch's allocation, for the next.
    spare: Option<Arc<Batch<T>>>,
    seat: Seat,
}

pub(super) fn work<T: Send + Sync + 'static>(me: usize, shared: &Arc<Shared<T>>, env: &Arc<Env>) {
    worker_mark::set(shared.key(), me);
    let mut watch: Watch = vec![None; shared.lanes.len()];
    let mut keep = Keep {
        spare: None,
        seat: Seat::new(),
    };
    loop {
        match next_step(me, shared, &mut watch) {
            Step::Own => serve_own(me, shared, env, &mut keep),
            Step::Found(found) => {
                take_found(me, shared);
                run_found(Some(me), found, shared, env, &mut keep);
            }
            Step::Stop => return,
        }
    }
}

/// Worker `me` is about to run work it found elsewhere (the posted job, a
/// stalled worker's batch or a share of its lane). A publish may have
/// been queued to its own lane while it announced its wait: that push rang
/// only `me`, and woke no other worker to watch, since `me` was waiting;
/// and a worker that announced its wait then passed the lane by. So a
/// waiting worker is woken to watch that lane, or the publish would wait
/// for whatever `me` runs now, even a handler that blocks until it has run.
pub(super) fn take_found<T: Send + Sync + 'static>(me: usize, shared: &Shared<T>) {
    took_work(me, shared, false);
    shared.share_rest(me, false);
}

/// Worker `me` took work: its own lane's (`own`), or another's it helps.
fn took_work<T>(me: usize, shared: &Shared<T>, own: bool) {
    shared.started[me].fetch_add(1, Ordering::SeqCst);
    if shared.free[me].load(Ordering::Relaxed) {
        shared.free[me].store(false, Ordering::SeqCst);
    }
    if shared.runs_own[me].load(Ordering::Relaxed) != own {
        shared.runs_own[me].store(own, Ordering::Relaxed);
    }
}

/// Serves worker `me`'s own lane, which it has begun to serve, until it is
/// empty.
fn serve_own<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    env: &Arc<Env>,
    keep: &mut Keep<T>,
) {
    let lane = &shared.lanes[me];
    let mut finished = 0;
    while let Next::Work(work) = lane.next(Server::Task, 0, finished) {
        took_work(me, shared, true);
        finished = work.publishes();
        run_work(Some(me), work, shared, env, keep);
    }
}

/// Runs work a worker took from a lane (`me`: the worker; `None` for a
/// `close`'s stand-in): a batch, shown for another worker to join if it
/// stalls, or a lone job that claims and enlists helpers while a worker is
/// free (one that turns free later joins it if it stalls).
fn run_work<T: Send + Sync + 'static>(
    me: Option<usize>,
    work: Work<T>,
    shared: &Shared<T>,
    env: &Arc<Env>,
    keep: &mut Keep<T>,
) {
    match work {
        Work::Batch(batch) => {
            if let Some(me) = me.filter(|&me| shared.runs_own[me].load(Ordering::Relaxed)) {
                shared.cores.look(me, &mut keep.seat, |worker| {
                    shared.runs_own[worker].load(Ordering::Relaxed)
                });
            }
            let batch = batch_of(&mut keep.spare, batch.into_jobs());
            let shown = batch
                .first()
                .is_some_and(|first| first.total() > 1)
                .then(|| Joinable::Batch(Arc::clone(&batch)));
            run_shown(me, shared, shown, || run_batch(&batch, shared, env));
            keep.spare = Some(emptied(batch));
        }
        Work::Job(job) => {
            let shown = (job.has_one_claiming_runner() && job.plan().max_runners > 1)
                .then(|| Joinable::Job(Arc::clone(&job)));
            run_shown(me, shared, shown, || run_job(&job, shared, env));
        }
    }
}

/// Runs what a worker (`me`; `None`: the stand-in) found elsewhere.
fn run_found<T: Send + Sync + 'static>(
    me: Option<usize>,
    found: Found<T>,
    shared: &Shared<T>,
    env: &Arc<Env>,
    keep: &mut Keep<T>,
) {
    match found {
        Found::Help(job) => run_job(&job, shared, env),
        Found::Join(batch) => run_batch(&batch, shared, env),
        Found::Share(work, from) => {
            let finished = work.publishes();
            run_work(me, work, shared, env, keep);
            shared.share_done(from, finished);
        }
    }
}

/// Runs `run` on worker `me` with `shown` (work another worker may join)
/// in its slot meanwhile, after waking a waiting worker to watch it. The
/// stand-in (`None`) shows nothing: it is no worker another would watch.
fn run_shown<T: Send + Sync + 'static>(
    me: Option<usize>,
    shared: &Shared<T>,
    shown: Option<Joinable<T>>,
    run: impl FnOnce(),
) {
    let Some(me) = me else {
        return run();
    };
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
        job: Some(job),
        env,
        place: Place::Worker,
    };
    let mut tally = Tally::default();
    job.run(env, &mut runner, &mut tally);
    env.counters.add(&tally);
}

/// Runs (or joins) `batch` on a worker. A batch's runners enlist no
/// helpers: the job is only for that.
fn run_batch<T: Send + Sync + 'static>(batch: &Batch<T>, shared: &Shared<T>, env: &Arc<Env>) {
    let mut runner = PoolRunner {
        shared,
        job: None,
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

/// What worker `me` does next: its own lane if it was started for it (and
/// then it has begun to serve it), then work a stalled worker is held up
/// on, then the posted job; waits for its bell when there is nothing.
/// `Stop` once stopping and all is run.
///
/// Whatever needs the worker at its own lane rings its bell (a push that
/// found the lane without it), and a bell stays rung until the worker
/// waits: so the worker looks at its lane at the top of each turn, and not
/// again before it waits.
fn next_step<T: Send + Sync + 'static>(
    me: usize,
    shared: &Shared<T>,
    watch: &mut Watch,
) -> Step<T> {
    loop {
        if shared.lanes[me].worker_begins() {
            return Step::Own;
        }
        // Nothing of its own left, whatever it helps with or waits for next.
        if !shared.free[me].load(Ordering::Relaxed) {
            shared.free[me].store(true, Ordering::SeqCst);
        }
        if shared.runs_own[me].load(Ordering::Relaxed) {
            shared.runs_own[me].store(false, Ordering::Relaxed);
        }
        let workers = shared.lanes.len();
        match shared.take_from((1..workers).map(|offset| (me + offset) % workers), watch) {
            Elsewhere::Took(found) => return Step::Found(found),
            Elsewhere::Watching => {
                if let Some(job) = shared.take_wanted() {
                    return Step::Found(Found::Help(job));
                }
                shared.wait(me, Some(STALL));
                continue;
            }
            Elsewhere::Nothing => {}
        }
        if shared.stopping.load(Ordering::SeqCst) {
            if !shared.lanes[me].is_busy() {
                return Step::Stop;
            }
            // A share of this lane is out (its room is held): wait for it
            // to have run.
            shared.wait(me, Some(STALL));
            continue;
        }
        shared.announce_wait(me);
        // Looked at after announcing the wait: see `Shared::share_rest`. A
        // worker that was waking up when this one passed its lane by may be
        // in a slow handler now with work queued behind it.
        if shared.stranded_work(me) {
            shared.end_wait(me);
            continue;
        }
        // Looked at after announcing the wait: see `Shared::want_help`.
        if let Some(job) = shared.take_wanted() {
            shared.end_wait(me);
            return Step::Found(Found::Help(job));
        }
        shared.wait(me, None);
        shared.end_wait(me);
    }
}

/// Runs, on a thread that is no worker (a `close` waiting from inside a
/// handler, which may hold up a worker: in a pool of one, the only one),
/// one piece of work a stalled worker is held up on, as a worker with
/// nothing of its own would take it: what that worker runs and another may
/// join, or a share of its lane. Returns whether it ran any.
pub(super) fn stand_in<T: Send + Sync + 'static>(
    shared: &Shared<T>,
    env: &Arc<Env>,
    watch: &mut Watch,
) -> bool {
    let before = watch.clone();
    let Elsewhere::Took(found) = shared.take_from(0..shared.lanes.len(), watch) else {
        return false;
    };
    // The worker it took from is still held up (its started count has not
    // moved): keep watching it from then, not anew, or every piece taken
    // costs another `STALL` and a burst queued behind the caller drains at
    // one piece a millisecond.
    for (now, then) in watch.iter_mut().zip(before) {
        if now.is_none() {
            *now = then;
        }
    }
    let mut keep = Keep {
        spare: None,
        seat: Seat::new(),
    };
    run_found(None, found, shared, env, &mut keep);
    true
}
