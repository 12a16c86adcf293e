//! `DeliveryMode::WorkerPool`: runners are jobs on bounded queues served by
//! a fixed set of threads, one queue per worker. Each queue is a [`Lane`]
//! (`lane.rs`), the queue engine `TaskPerSubscriber` runs on too: the two
//! modes differ in who serves a lane (here a thread of the pool, the
//! lane's "task"; there a tokio task) and in what a publisher does at a
//! full one, not in how work is queued, batched and counted.
//!
//! [`Lane`]: super::lane::Lane
//!
//! # Where work goes
//! - A publish goes to its route's *home* worker (`registry/route.rs`: routes
//!   get homes in turn, and a home moves to an idle worker when another
//!   route's publishes keep its worker busy: `placement.rs`). So one
//!   topic's publishes run one after another on one thread, and two busy
//!   topics run on two. Handlers that share state
//!   (one counter for all) then never fight over it between cores, and
//!   handlers with state of their own keep it in one core's cache; with a
//!   publish cut into per-worker chunks, the first kind ran 3-4x slower than
//!   on one core (see `docs/design-notes.md`, "Where a subscription runs").
//!   The one exception is `Batch::Single` below the threshold: there every
//!   subscription is a unit of its own (BlazeSub's individual delivery),
//!   and the units go to the queues in turn.
//! - A worker that takes a publish also takes the publishes queued right
//!   behind it in its lane to the same subscriptions, up to
//!   [`MAX_BATCH`](super::fanout::MAX_BATCH) in all, and runs them subscription by subscription
//!   ([`Batch`](super::batch::Batch)): the entries are walked once per batch, and an ordered
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
//!   rule: the owner keeps the rest: `Lane::take_share`). Until then it
//!   watches, waking every
//!   `STALL`. Taking at once, as an idle worker did before, put two cores
//!   on one topic's handlers during every burst.
//! - No work is left queued, or unclaimed in a running batch, behind a
//!   stalled worker while another waits for ever. A batch is gathered by
//!   looking at the lane's head under its lock, so a publish that does not
//!   fit stays queued where others take it. A worker that announces its
//!   wait looks once more for such work of a worker that is not waiting,
//!   and watches it instead of waiting; a publisher that queues for a busy
//!   worker, or a worker about to run something with more queued behind it
//!   or with units another could join, wakes a waiting one. The two sides
//!   store before they load, so one of them always sees the other
//!   (`loom_tests.rs` checks both with a handler that blocks until the
//!   others have run).
//! - A worker waits on a bell of its own. A push that finds the lane
//!   without its worker (the lane's task left it empty) rings it; the lane
//!   decides that under its lock, and a bell stays rung until its worker
//!   waits, so nothing queued waits for a worker asleep. A share taken from
//!   a lane leaves that lane's task started (a lane with work queued always
//!   has it), so its worker comes back to the rest.
//!
//! A queue holds `queue_capacity / workers` publishes (at least one), not
//! counting the one its worker started with: the other publishes of the
//! batch it runs, and a share another worker took, keep their room until
//! they have run. A queued publish is one runner of one publish
//! (an `Arc` of its job), so a burst costs no allocation per queued runner.
//! When a queue is full the overflow policy
//! applies: `Wait` (the default) has the publisher wait until the queue has
//! drained to half (only that lane wakes it: each lane has its own
//! waiters), except on a pool worker, where it runs the job itself
//! as `CallerRuns` does (the room it would wait for may be its own), and
//! except once the lane has made no take since the publisher found it
//! full, over a wait of up to [`STALL`], while a worker is driving an async
//! handler's future itself (at
//! the task cap): that future may wait for what only the publisher's thread
//! can free (a timer of the runtime the publisher is a thread of), so the
//! publisher runs the job itself rather than wait for ever. A worker that
//! is only slow is waited for. `Drop` and `Error` count the deliveries as
//! dropped.
//!
//! While a `close` called from inside a handler waits, a thread of its own
//! stands in for the workers: it takes what a stalled worker is held up
//! on, as an idle worker would, and runs it. The handler
//! may hold up its worker with publishes queued behind it that `close`
//! waits for; in a pool of one worker, nobody else could run them.
//!
//! Two busy workers on one CPU run at half speed each while the other CPU
//! may only run publishers that mostly wait for queue room; the kernel can
//! leave them so for a whole burst. A busy worker that starts a batch on a
//! CPU another busy worker holds moves to a CPU nobody busy holds, if its
//! affinity mask has one, and keeps that mask (`cores.rs`; Linux only).
//!
//! Stopping sets a flag and wakes every worker and every waiting publisher
//! (which then runs its job itself); a worker stops once its own lane is
//! empty (no share of it out) and it finds nothing to take elsewhere, so
//! everything queued before still runs. `close` and dropping the bus both
//! stop the pool this way.
//!
//! # Files
//! - `mod.rs` — the pool's handle: starting the workers, queueing a
//!   publish's runners, stopping.
//! - `shared.rs` — what the handle and the workers share: the lanes, the
//!   bells, the wait flags, the running slots, the posted job.
//! - `worker.rs` — a worker's loop: serving its lane, finding work a
//!   stalled worker holds up, and running it.
//! - `cores.rs` — which CPU each busy worker runs on, and the move off a
//!   CPU another busy worker holds.

mod cores;
mod shared;
mod worker;

use std::sync::Arc;
use std::time::Duration;

use self::shared::Shared;
use super::pending::{self, Handed, Place};
use super::placement::Placement;
use super::{caller_runs, refused, run_for_held_runner, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::error::Error;
use crate::registry::entry::BoxFuture;
use crate::registry::route::Home;
use crate::stats::Tally;
use crate::sync::{thread, worker_mark, AtomicBool, AtomicUsize, Ordering};

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

pub(crate) struct Pool<T> {
    shared: Arc<Shared<T>>,
    /// Turns for the units of `Batch::Single` below the threshold.
    turn: AtomicUsize,
    /// Whether a stand-in is out (see [`Pool::stand_in`]): at most one at
    /// a time, however many `close` calls wait from handlers (one retried
    /// under a timeout starts a waiter each time).
    standing_in: AtomicBool,
    /// Which worker each route's publishes go to.
    placement: Placement,
}

impl<T: Send + Sync + 'static> Pool<T> {
    pub(crate) fn start(workers: usize, capacity: usize, env: &Arc<Env>) -> Result<Self, Error> {
        let per_worker = capacity.div_ceil(workers.max(1)).max(1);
        let pool = Self {
            shared: Arc::new(Shared::new(workers, per_worker)),
            turn: AtomicUsize::new(0),
            standing_in: AtomicBool::new(false),
            placement: Placement::new(workers),
        };
        for index in 0..workers {
            let shared = Arc::clone(&pool.shared);
            let env = Arc::clone(env);
            thread::Builder::new()
                .name(format!("blazesub-worker-{index}"))
                .spawn(move || worker::work(index, &shared, &env))
                // Dropping `pool` stops the workers already started.
                .map_err(Error::Spawn)?;
        }
        Ok(pool)
    }

    /// The worker a publish of the route with `home` goes to: its home
    /// worker, or an idle one it moves to when another route's publishes
    /// keep that one busy (`placement.rs`).
    pub(crate) fn place(&self, home: &Home) -> usize {
        // The calling worker is never idle to its own publish: it runs the
        // handler that publishes (maybe helping another worker, which
        // `busy` counts as idle), and a request's job moved behind it would
        // wait for it (`runs_request_here` is decided before this).
        // Read only off the fast path (a route resident at its place).
        self.placement.place(home, |worker| {
            self.shared.busy(worker) || worker_mark::index_in(self.shared.key()) == Some(worker)
        })
    }

    /// Queues the job's runners; see the module docs for a full queue.
    pub(crate) fn dispatch(&self, job: Arc<Fanout<T>>, env: &Arc<Env>) -> usize {
        let plan = job.plan();
        if pending::holds_runner_here(env) {
            // Made by an async delivery this worker finishes in place.
            run_for_held_runner(&job, env, || self.publisher_runner(&job, env));
            return 0;
        }
        let workers = self.shared.lanes.len();
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
                job.place() % workers
            };
            let queued = if wait {
                self.shared.push_waiting(worker, &job)
            } else {
                self.shared.push(worker, &job).map_err(|_| ())
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
            job: Some(job),
            env,
            place: Place::Publisher,
        }
    }
}

impl<T: Send + Sync + 'static> Pool<T> {
    /// Whether a request made on this thread to a route with `home` runs
    /// its job here: this thread is a worker of this pool, and
    /// - a sync handler makes it (outside an async delivery's first poll):
    ///   it blocks this worker until the reply comes, and a job it queued
    ///   could wait behind workers blocked the same way (this one, or
    ///   another whose handler waits for a request queued here);
    /// - an async handler makes it in its first poll, and the job would
    ///   queue behind this very worker (its own queue, or the only one): at
    ///   the task cap this worker finishes that delivery itself, blocking
    ///   on it. Anywhere else the first poll returns when it waits, and the
    ///   job is queued: the request keeps its deadline.
    pub(crate) fn runs_request_here(&self, home: usize) -> bool {
        let workers = self.shared.lanes.len();
        worker_mark::index_in(self.shared.key())
            .is_some_and(|me| !pending::in_first_poll() || workers == 1 || home % workers == me)
    }
}

impl<T: Send + Sync + 'static> Pool<T> {
    /// A step for the stand-in of a `close` waiting from inside a handler
    /// (a thread of its own, beside the one `close` waits on): runs one
    /// piece of work a stalled worker is held up on, if any, and says
    /// whether it did. The handler may be holding up a worker with work
    /// queued behind it that `close` waits for and no other worker could
    /// take: in a pool of one, nobody else could.
    ///
    /// `None` while another stand-in is out: the thread running it may be
    /// blocked in a handler it took, and each more would take one more
    /// held-up publish onto a thread of its own (a `close` retried under a
    /// timeout from a handler would add one each time).
    pub(crate) fn stand_in<'a>(
        &'a self,
        env: &'a Arc<Env>,
    ) -> Option<impl FnMut() -> bool + Send + 'a> {
        /// Lets the next stand-in out when this one is dropped.
        struct Out<'a>(&'a AtomicBool);
        impl Drop for Out<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        if self.standing_in.swap(true, Ordering::SeqCst) {
            return None;
        }
        let out = Out(&self.standing_in);
        let mut watch = vec![None; self.shared.lanes.len()];
        Some(move || {
            let _out = &out;
            worker::stand_in(&self.shared, env, &mut watch)
        })
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
        for lane in &self.shared.lanes {
            lane.wake_waiting();
        }
    }

    /// Lets the workers finish what is queued, then stop. Idempotent.
    pub(crate) fn shut_down(&self) {
        self.stop_waiting();
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        for worker in 0..self.shared.lanes.len() {
            self.shared.ring(worker);
        }
    }
}

impl<T> Drop for Pool<T> {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A runner on a worker thread, or on a publisher the queue had no room for.
struct PoolRunner<'a, T> {
    shared: &'a Shared<T>,
    /// The job it runs by its claims, which a helper may join (none for a
    /// batch: its runners enlist no helpers).
    job: Option<&'a Arc<Fanout<T>>>,
    env: &'a Arc<Env>,
    place: Place,
}

impl<T: Send + Sync + 'static> Runner<T> for PoolRunner<'_, T> {
    fn has_idle_capacity(&self) -> bool {
        self.job.is_some() && self.shared.has_free_worker()
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        let Some(job) = self.job else {
            return false;
        };
        // Posted, not queued: the next worker about to wait takes it, so a
        // worker that turns free later still helps.
        let replaced = self.shared.want_help(job);
        drop(replaced);
        true
    }

    /// A publisher running its job itself (the queue had no room for it,
    /// or it publishes from a delivery its runner waits for) claims all of
    /// it: a handler of it that blocks on `close` holds up the rest, which
    /// must then count as held by this thread's stack, not be waited for.
    fn claims_rest(&self) -> bool {
        self.place == Place::Publisher
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) -> bool {
        if self.place != Place::Worker {
            return matches!(
                pending::settle(delivery, self.env, self.place, tally),
                Handed::Away
            );
        }
        // Counted while it may drive the future itself (see
        // `Shared::push_waiting`); a panic there is caught inside.
        self.shared.driving.fetch_add(1, Ordering::SeqCst);
        let handed = pending::settle(delivery, self.env, self.place, tally);
        self.shared.driving.fetch_sub(1, Ordering::SeqCst);
        matches!(handed, Handed::Away)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::shared::{Elsewhere, Found};
    use super::*;
    use crate::config::{Config, DeliveryMode};
    use crate::dispatch::lane::{Next, Server, Work};
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
                Subscriber::new(SyncSink(|_: &Message<u32>| {})).into_handler();
            assert!(trie.insert::<Handlers>(topic, id, |_| entry).is_ok());
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
            assert!(shared.push(0, job).is_ok());
        }
        let lane = &shared.lanes[0];
        assert!(lane.worker_begins(), "the first push started worker 0");
        let Next::Work(Work::Batch(batch)) = lane.next(Server::Task, 0, 0) else {
            panic!("worker 0 takes a batch");
        };
        let jobs = batch.into_jobs();
        assert_eq!(
            jobs.len(),
            4,
            "the job and the three publishes behind it to the same route"
        );
        assert!(jobs.iter().zip(&same).all(|(a, b)| Arc::ptr_eq(a, b)));
        assert!(lane.has_queued(), "another route's job is left to run next");
        let Next::Work(Work::Job(job)) = lane.next(Server::Task, 0, jobs.len()) else {
            panic!("worker 0 takes the other route's job");
        };
        assert!(Arc::ptr_eq(&job, &other[0]));
        assert!(matches!(
            lane.next(Server::Task, 0, 1),
            Next::Left { start_task: false }
        ));
        assert!(!lane.is_busy(), "every publish's room is back");
    }

    /// A worker with nothing of its own leaves a busy worker's lane alone
    /// while that worker keeps starting work: two workers on one topic's
    /// burst put its handlers on two cores, and handlers that share state
    /// ran 3-4x slower there than on one.
    #[test]
    fn an_idle_worker_takes_nothing_from_a_worker_that_keeps_starting_work() {
        let shared = Shared::<u32>::new(2, 16);
        for job in chunked_jobs(100, 7) {
            assert!(shared.push(1, &job).is_ok());
        }
        let mut watch = vec![None; 2];
        for _ in 0..3 {
            assert!(matches!(
                shared.take_from(std::iter::once(1), &mut watch),
                Elsewhere::Watching
            ));
            std::thread::sleep(STALL * 2);
            // Worker 1 started another piece of work meanwhile.
            shared.started[1].fetch_add(1, Ordering::SeqCst);
        }
        assert!(shared.lanes[1].worker_begins(), "nothing taken");
        let Next::Work(work) = shared.lanes[1].next(Server::Task, 0, 0) else {
            panic!("all 7 still queued");
        };
        assert_eq!(work.publishes(), 7);
    }

    /// A worker that announced its wait, then took the posted job, while a
    /// publish was queued to its own lane (the push rang only it, and woke
    /// no helper, since it was waiting; another waiting worker passed the
    /// lane by for the same reason): before it runs what it found, it wakes
    /// a waiting worker to watch its lane. Otherwise that publish waited
    /// for the job it helps, even a handler blocked until it had run (found
    /// by review; the same path was in the pool before its lanes).
    #[test]
    fn a_worker_that_helps_elsewhere_leaves_its_own_queued_lane_watched() {
        let shared = Shared::<u32>::new(3, 16);
        shared.announce_wait(1);
        let job = &jobs_on("t", 1, 1, 10)[0];
        assert!(shared.push(1, job).is_ok());
        shared.announce_wait(2);
        assert!(
            !shared.stranded_work(2),
            "worker 2 passes worker 1's lane by: worker 1 waits"
        );
        // Worker 1 takes the posted job instead of its bell's work.
        shared.end_wait(1);
        worker::take_found(1, &shared);
        assert!(
            !shared.waiting[2].load(Ordering::SeqCst),
            "worker 2 is woken to watch worker 1's lane"
        );
    }

    /// A worker with nothing of its own takes a batch from a stalled one
    /// (it started nothing for `STALL`), as the owner would: at most half
    /// of what is left, so the owner keeps the rest. One publish at a time,
    /// it walked the owner's subscriptions a publish at a time beside it
    /// (an ordered subscription then took a runner's turn per message).
    #[test]
    fn an_idle_worker_takes_half_of_a_stalled_workers_lane_as_one_batch() {
        let shared = Shared::<u32>::new(2, 16);
        for job in chunked_jobs(100, 7) {
            assert!(shared.push(1, &job).is_ok());
        }
        let mut watch = vec![None; 2];
        assert!(matches!(
            shared.take_from(std::iter::once(1), &mut watch),
            Elsewhere::Watching
        ));
        std::thread::sleep(STALL * 2);
        let Elsewhere::Took(Found::Share(work, from)) =
            shared.take_from(std::iter::once(1), &mut watch)
        else {
            panic!("worker 0 takes a share of worker 1's lane once worker 1 stalls");
        };
        assert_eq!(from, 1);
        assert_eq!(work.publishes(), 4, "the head and half of the 6 behind it");
        // Run elsewhere (here: dropped unrun), the share gives its room back.
        drop(work);
        shared.share_done(from, 4);
        // The owner takes what is left of its own lane.
        assert!(shared.lanes[1].worker_begins());
        let Next::Work(rest) = shared.lanes[1].next(Server::Task, 0, 0) else {
            panic!("the owner keeps the rest");
        };
        assert_eq!(rest.publishes(), 3);
        assert!(!shared.lanes[1].has_queued());
    }
}
