//! `DeliveryMode::TaskPerSubscriber`: runners are tokio tasks.
//!
//! # Where work goes
//! A publish goes to its route's [`Lane`] (`lane.rs`): one per worker, as
//! the pool has one queue per worker, and as there a route's home moves to
//! an idle lane when another route's publishes keep its own busy
//! (`placement.rs`). A lane's publishes are run by one
//! task at a time, the lane's task, which takes the publishes queued to the
//! same subscriptions as one batch, so one topic's handlers run in one
//! place, publish after publish, and handlers that share state do not fight
//! over it between cores (spread over two cores, a shared counter made a
//! publish 3-4x slower than on one: `docs/design-notes.md`, "Where a
//! subscription runs"). The lane's task yields to the runtime every
//! [`YIELD_AFTER`] deliveries, so it never holds a runtime thread for long.
//!
//! A *lone* publish (nothing queued or running in its lane) that may use
//! several runners also gets helper runner tasks, up to `max_runners - 1`
//! while fewer than `workers` of the bus's tasks are alive: they claim its
//! units beside the lane's task, so a slow handler holds up only the runner
//! it is on, and a big fan-out uses every core. `Batch::Single` below the
//! threshold keeps BlazeSub's shape: a task per subscription.
//!
//! # Where nothing depends on tokio's placement
//! A task spawned from a runtime thread lands in that thread's LIFO slot,
//! which no other thread steals and which runs only once the spawning task
//! yields. A publisher that never yields may so hold its lane's task. The
//! lane is bounded (`max_inflight_tasks / workers` publishes); a publisher
//! that finds it full:
//! - under `Overflow::Wait` (the default), serves the lane itself down to
//!   half its capacity if nobody serves it, and otherwise waits for room,
//!   serving beside the lane's server once that has started nothing for
//!   [`STALL`] (a stuck handler), down to half the lane, or, with no more
//!   than half of it queued (the rest held by that server), running its
//!   own job: the server may be stuck on this very thread (an async
//!   handler finished in place awaits a timer of the runtime whose threads
//!   are all publishers waiting for room). A publish made from inside a
//!   handler, or once the bus is closing, never waits: it runs its job
//!   itself.
//! - under `CallerRuns`, runs its job itself;
//! - under `Drop` and `Error`, counts its deliveries as dropped.
//!
//! A lane whose publishes sit behind a task that has not run, or behind a
//! server stuck in a handler, while its publisher no longer publishes, is
//! found by the lanes' watcher (`lane_watch.rs`), a thread of the bus that
//! starts a helper task for it from outside the runtime, so the helper
//! goes to the runtime's shared queue.
//!
//! So the lane makes progress wherever tokio puts its task, and where the
//! task cannot run (a one-thread runtime whose publisher does not yield),
//! the publisher does the work, as `Inline` would.
//!
//! # Task slots
//! Every task (a lane's, a helper, a continued async delivery) holds a slot
//! of `max_inflight_tasks`. A lane whose task cannot get one is served by
//! its publisher (`Wait`, `CallerRuns`) or has its publishes counted as
//! dropped (`Drop`, `Error`).
//!
//! # Closing, and a runtime that shuts down
//! When the bus starts closing, waiting publishers stop waiting, and a
//! thread serves every lane that has publishes queued behind a server (a
//! handler blocked in `close` may be that server). A lane task the runtime
//! drops before it ran, or while it awaited, counts the lane's queued
//! deliveries as dropped (unless another server is on the lane), so nothing
//! accepted vanishes uncounted.

use std::sync::Arc;

use tokio::runtime::Handle;

use super::lane::{Lane, Next, Pushed, Server, Work};
use super::lane_watch::LaneWatch;
use super::pending::{self, Handed, Place};
use super::permit::TaskPermit;
use super::placement::Placement;
use super::pool::STALL;
use super::{caller_runs, refused, run_for_held_runner, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::error::Error;
use crate::registry::entry::BoxFuture;
use crate::registry::quiesce;
use crate::registry::route::Home;
use crate::stats::Tally;
use crate::sync::{AtomicBool, Ordering};

/// Deliveries a lane's task runs between two yields to the runtime: about
/// half a millisecond of cheap handlers.
const YIELD_AFTER: u64 = 65_536;

pub(crate) struct Tasks<T> {
    handle: Handle,
    lanes: Vec<Arc<Lane<T>>>,
    watch: Arc<LaneWatch<T>>,
    /// The bus is closing: publishers wait no more.
    closing: AtomicBool,
    /// Which lane each route's publishes go to.
    placement: Placement,
}

impl<T: Send + Sync + 'static> Tasks<T> {
    pub(crate) fn start(
        handle: Handle,
        workers: usize,
        max_inflight_tasks: usize,
        env: &Arc<Env>,
    ) -> Result<Self, Error> {
        let lanes = workers.max(1);
        let capacity = (max_inflight_tasks / lanes).max(1);
        let lanes: Vec<_> = (0..lanes).map(|_| Arc::new(Lane::new(capacity))).collect();
        let watch = {
            let (handle, env) = (handle.clone(), Arc::clone(env));
            LaneWatch::start(lanes.clone(), move |lane| {
                if let Some(permit) = TaskPermit::acquire(&env) {
                    spawn_lane_task(&handle, Arc::clone(lane), permit, Server::Other);
                }
            })?
        };
        Ok(Self {
            handle,
            placement: Placement::new(lanes.len()),
            lanes,
            watch,
            closing: AtomicBool::new(false),
        })
    }

    /// The lane a publish of the route with `home` goes to: its home lane,
    /// or an idle one it moves to when another route's publishes keep that
    /// one busy (`placement.rs`).
    pub(crate) fn place(&self, home: &Home) -> usize {
        self.placement
            .place(home, |lane| self.lanes[lane].is_busy())
    }

    /// Hands `job` to its lane, or to tasks of its own (`Batch::Single`
    /// below the threshold). Returns the deliveries dropped for lack of
    /// room.
    pub(crate) fn dispatch(&self, job: Arc<Fanout<T>>, env: &Arc<Env>) -> usize {
        let plan = job.plan();
        if pending::holds_runner_here(env) {
            // Made by an async delivery a lane's task awaits at the task cap.
            run_for_held_runner(&job, env, || TaskModeRunner::new(env, Place::Publisher));
            return 0;
        }
        if plan.single_claim && plan.runners > 1 {
            return self.spawn_units(&job, env);
        }
        self.queue(job, env)
    }

    /// Queues `job` in its lane; see the module docs for a full lane.
    fn queue(&self, job: Arc<Fanout<T>>, env: &Arc<Env>) -> usize {
        let lane = &self.lanes[job.place() % self.lanes.len()];
        let helpable = job.plan().max_runners > 1;
        loop {
            let (serving, started) = match lane.push(&job, helpable) {
                Pushed::Queued { start_task, lone } => {
                    let dropped = if start_task {
                        self.start_task(lane, env, Some(&job))
                    } else {
                        0
                    };
                    if lone {
                        self.start_more_runners(&job, env);
                    }
                    self.watch.arm();
                    return dropped;
                }
                Pushed::Full { serving, started } => (serving, started),
            };
            match env.overflow {
                Overflow::Drop | Overflow::Error => return refused(&job, false, env),
                Overflow::CallerRuns => {
                    caller_runs(&job, &mut TaskModeRunner::caller(env), env);
                    return 0;
                }
                Overflow::Wait => {
                    // A handler's publish may wait for its own lane.
                    if quiesce::held_by_any_bus_here() || self.closing.load(Ordering::SeqCst) {
                        caller_runs(&job, &mut TaskModeRunner::caller(env), env);
                        return 0;
                    }
                    if (serving == 0 || !lane.wait_for_room(started, STALL))
                        && !self.serve_before(&job, lane, env)
                        && serving > 0
                    {
                        // Stalled, and nothing queued to take: what fills
                        // the lane is held by a server stuck in a handler,
                        // which may be waiting for this very thread (a
                        // timer of the runtime this publisher is a thread
                        // of). Waiting on could never end.
                        caller_runs(&job, &mut TaskModeRunner::caller(env), env);
                        return 0;
                    }
                }
            }
        }
    }

    /// [`Self::serve`] down to half the lane, by a publisher whose own `job`
    /// waits for room meanwhile. That job's deliveries count as held by this
    /// thread's stack while it serves: they cannot run before the handlers
    /// run here return, so a `close` one of them blocks on must not wait for
    /// them (it would wait until its timeout).
    fn serve_before(&self, job: &Fanout<T>, lane: &Arc<Lane<T>>, env: &Arc<Env>) -> bool {
        let own = job.total() as u64;
        let _held = quiesce::HeldHere::new(&env.quiescence, own);
        self.serve(lane, lane.capacity() / 2, env)
    }

    /// Serves `lane` on this thread while more than `until` publishes are
    /// queued; `false` if there was nothing to take.
    fn serve(&self, lane: &Arc<Lane<T>>, until: usize, env: &Arc<Env>) -> bool {
        lane.other_begins();
        // A publish it takes is claimed whole (see `Runner::claims_rest`):
        // a handler run here that blocks on `close` holds up the rest of
        // it, which must not be waited for.
        let mut runner = TaskModeRunner::caller(env);
        let mut finished = 0;
        let mut ran = false;
        loop {
            match lane.next(Server::Other, until, finished) {
                Next::Work(work) => {
                    ran = true;
                    env.counters.caller_ran();
                    let mut tally = Tally::default();
                    // On the publisher's stack: see `caller_runs`.
                    let _deeper = super::inline::Deeper::enter();
                    work.run(env, &mut runner, &mut tally);
                    env.counters.add(&tally);
                    finished = work.publishes();
                    drop(work);
                }
                Next::Left { start_task } => {
                    if start_task {
                        self.start_task(lane, env, None);
                    }
                    return ran;
                }
            }
        }
    }

    /// Starts `lane`'s task (the lane counts it as started). Without a task
    /// slot the caller serves the lane, or counts its publishes as dropped
    /// (`Drop`, `Error`: other publishers' too, queued meanwhile for the
    /// task that could not start); returns how many deliveries of `own`
    /// (the caller's publish) that dropped, which is what `Error` reports.
    fn start_task(
        &self,
        lane: &Arc<Lane<T>>,
        env: &Arc<Env>,
        own: Option<&Arc<Fanout<T>>>,
    ) -> usize {
        if let Some(permit) = TaskPermit::acquire(env) {
            spawn_lane_task(&self.handle, Arc::clone(lane), permit, Server::Task);
            return 0;
        }
        let jobs = lane.task_gone();
        let mut dropped = 0;
        for job in jobs {
            match env.overflow {
                Overflow::Wait | Overflow::CallerRuns => {
                    caller_runs(&job, &mut TaskModeRunner::caller(env), env);
                }
                Overflow::Drop | Overflow::Error => {
                    let refused = refused(&job, false, env);
                    if own.is_some_and(|own| Arc::ptr_eq(own, &job)) {
                        dropped += refused;
                    }
                }
            }
        }
        dropped
    }

    /// The bus starts closing: publishers wait no more. (A lane whose
    /// server is the handler that called `close` is served by a helper the
    /// watcher starts.)
    pub(crate) fn closing(&self) {
        if self.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        for lane in &self.lanes {
            lane.wake_waiting();
        }
    }

    /// `Batch::Single` below the threshold: a task per unit.
    fn spawn_units(&self, job: &Arc<Fanout<T>>, env: &Arc<Env>) -> usize {
        let mut started = false;
        let mut dropped = 0;
        let runners = job.plan().runners;
        for runner in 0..runners {
            match TaskPermit::acquire(env) {
                Some(permit) => {
                    spawn_runner(&self.handle, Arc::clone(job), permit);
                    started = true;
                }
                None => match env.overflow {
                    // A runtime thread that waited for a task slot could be
                    // the one the tasks need: `Wait` runs here too. Only
                    // this unit: the ones after it still go to tasks once
                    // slots are free again, in parallel. Until then they
                    // have no runner and cannot start before this returns,
                    // so they count as held by this thread's stack: a
                    // handler of this unit that blocks on `close` must not
                    // wait for them. (A unit is one delivery here.)
                    Overflow::Wait | Overflow::CallerRuns => {
                        let later = ((runners - runner - 1) * job.plan().unit) as u64;
                        let _held = quiesce::HeldHere::new(&env.quiescence, later);
                        caller_runs(job, &mut TaskModeRunner::caller(env), env);
                    }
                    Overflow::Drop | Overflow::Error => dropped += refused(job, started, env),
                },
            }
        }
        dropped
    }

    /// The helper runners of a lone publish, while workers look free (see
    /// the module docs). A slot the cap refuses is no loss: the lane's task
    /// claims every unit left.
    fn start_more_runners(&self, job: &Arc<Fanout<T>>, env: &Arc<Env>) {
        for _ in job.plan().runners..job.plan().max_runners {
            if env.tasks.live() >= env.workers {
                return;
            }
            let Some(permit) = TaskPermit::acquire(env) else {
                return;
            };
            spawn_runner(&self.handle, Arc::clone(job), permit);
        }
    }
}

/// Spawns a task serving `lane`: its own task (`Server::Task`), or a
/// helper beside a stuck server (`Server::Other`, from the watcher).
fn spawn_lane_task<T: Send + Sync + 'static>(
    handle: &Handle,
    lane: Arc<Lane<T>>,
    permit: TaskPermit,
    server: Server,
) {
    // Built before the spawn, so a task the runtime drops unpolled still
    // accounts for the lane's work.
    if server == Server::Other {
        lane.helper_coming();
    }
    let mut task = LaneTask {
        lane,
        server,
        permit: Some(permit),
        begun: false,
        left: false,
        tally: Tally::default(),
    };
    handle.spawn(async move { task.serve().await });
}

/// A task serving a lane: its hold on the lane and its task slot, and what
/// it did. Dropped before it left the lane (its runtime dropped it
/// unpolled, or while it awaited), it counts the lane's queued deliveries
/// as dropped unless another server is on the lane.
struct LaneTask<T: Send + Sync + 'static> {
    lane: Arc<Lane<T>>,
    server: Server,
    permit: Option<TaskPermit>,
    /// Served at least once (a helper counts as coming until then).
    begun: bool,
    left: bool,
    tally: Tally,
}

impl<T: Send + Sync + 'static> LaneTask<T> {
    /// Begins (or, after a pause, resumes) serving: `false` if the task
    /// has left instead (see `lane.rs`).
    fn begins(&mut self) -> bool {
        let begun = std::mem::replace(&mut self.begun, true);
        match self.server {
            Server::Task => self.lane.task_begins(),
            Server::Other if begun => {
                self.lane.other_begins();
                true
            }
            Server::Other => {
                self.lane.helper_begins();
                true
            }
        }
    }

    async fn serve(&mut self) {
        let env = Arc::clone(self.permit.as_ref().expect("held until drop").env());
        if !self.begins() {
            self.left = true;
            return;
        }
        let mut since_yield = 0;
        let mut finished = 0;
        loop {
            let work = match self
                .lane
                .next(self.server, 0, std::mem::take(&mut finished))
            {
                Next::Work(work) => work,
                Next::Left { start_task } => {
                    self.left = true;
                    if start_task {
                        start_lane_task(&self.lane, &env);
                    }
                    return;
                }
            };
            let awaited = self.run(&work, &env);
            finished = work.publishes();
            drop(work);
            let tally = std::mem::take(&mut self.tally);
            env.counters.add(&tally);
            since_yield += tally.finished;
            if awaited.is_empty() && since_yield < YIELD_AFTER {
                continue;
            }
            self.lane.pauses(std::mem::take(&mut finished));
            if awaited.is_empty() {
                tokio::task::yield_now().await;
            } else {
                pending::finish_here(awaited, &env, &mut self.tally).await;
                env.counters.add(&std::mem::take(&mut self.tally));
            }
            since_yield = 0;
            if !self.begins() {
                self.left = true;
                return;
            }
        }
    }

    /// Runs `work`, reporting it; returns the pending async deliveries the
    /// task must await itself.
    fn run(&mut self, work: &Work<T>, env: &Arc<Env>) -> Vec<BoxFuture> {
        let mut runner = TaskModeRunner::new(env, Place::Task);
        work.run(env, &mut runner, &mut self.tally);
        runner.awaited
    }
}

impl<T: Send + Sync + 'static> Drop for LaneTask<T> {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let env = Arc::clone(permit.env());
        let mut tally = std::mem::take(&mut self.tally);
        if !self.left {
            let mut dropped = 0;
            let jobs = match self.server {
                Server::Task => self.lane.task_gone(),
                Server::Other => self.lane.helper_gone(self.begun),
            };
            for job in jobs {
                dropped += job.drop_units(&mut tally);
            }
            if dropped > 0 {
                tracing::warn!(
                    dropped,
                    "the runtime dropped a lane's task before it ran its publishes; their deliveries are counted as dropped"
                );
            }
        }
        drop(permit);
        env.counters.add(&tally);
    }
}

/// Starts `lane`'s task from a task that left it with work queued (the
/// lane counts it as started). Without a task slot the lane's publishes
/// wait for the next server: a publisher, or a helper the watcher starts.
fn start_lane_task<T: Send + Sync + 'static>(lane: &Arc<Lane<T>>, env: &Arc<Env>) {
    let Some(handle) = env.handle.as_ref() else {
        return;
    };
    match TaskPermit::acquire(env) {
        Some(permit) => spawn_lane_task(handle, Arc::clone(lane), permit, Server::Task),
        None => {
            // Nobody may be left to serve them: count them, as a runtime
            // that dropped the task would.
            let mut tally = Tally::default();
            for job in lane.task_gone() {
                job.drop_units(&mut tally);
            }
            env.counters.add(&tally);
        }
    }
}

impl<T> Drop for Tasks<T> {
    fn drop(&mut self) {
        self.watch.stop();
    }
}

fn spawn_runner<T: Send + Sync + 'static>(
    handle: &Handle,
    job: Arc<Fanout<T>>,
    permit: TaskPermit,
) {
    // Built before the spawn, so a task the runtime drops unpolled (it is
    // shutting down, or already gone) still accounts for its job.
    let mut task = RunnerTask {
        job,
        permit: Some(permit),
        ran: false,
        tally: Tally::default(),
    };
    handle.spawn(async move {
        let env = Arc::clone(task.env());
        let awaited = {
            let mut runner = TaskModeRunner::new(&env, Place::Task);
            task.job.run(&env, &mut runner, &mut task.tally);
            std::mem::take(&mut runner.awaited)
        };
        task.ran = true;
        // Pending deliveries the cap kept from becoming tasks of their own.
        if !awaited.is_empty() {
            pending::finish_here(awaited, &env, &mut task.tally).await;
        }
        // Its drop gives the task slot back, then reports the tally.
        drop(task);
    });
}

/// A runner task's hold on its job and its task slot, and what it did.
/// Dropped, it gives the slot back *before* reporting its deliveries as
/// finished, so a publisher that sees `inflight` reach zero finds the slot
/// free. Dropped without having run (the runtime shut down before polling
/// it), it claims the units left in the job and counts their deliveries as
/// dropped, so nothing accepted vanishes uncounted and `inflight` returns to
/// zero.
struct RunnerTask<T: Send + Sync + 'static> {
    job: Arc<Fanout<T>>,
    permit: Option<TaskPermit>,
    ran: bool,
    tally: Tally,
}

impl<T: Send + Sync + 'static> RunnerTask<T> {
    fn env(&self) -> &Arc<Env> {
        self.permit.as_ref().expect("held until drop").env()
    }
}

impl<T: Send + Sync + 'static> Drop for RunnerTask<T> {
    fn drop(&mut self) {
        let env = Arc::clone(self.env());
        if !self.ran {
            let dropped = self.job.drop_units(&mut self.tally);
            if dropped > 0 {
                tracing::warn!(
                    topic = self.job.topic(),
                    dropped,
                    "the runtime dropped a delivery task before it ran; its deliveries are counted as dropped"
                );
            }
        }
        drop(self.permit.take());
        env.counters.add(&self.tally);
    }
}

/// A runner in this mode: a task, or the publisher running a runner the cap
/// had no room for.
struct TaskModeRunner<'a> {
    env: &'a Arc<Env>,
    place: Place,
    /// Runs a job no task could take (see [`Runner::claims_rest`]).
    alone: bool,
    /// Pending deliveries a task runner awaits itself (see `pending.rs`).
    awaited: Vec<BoxFuture>,
}

impl<'a> TaskModeRunner<'a> {
    fn new(env: &'a Arc<Env>, place: Place) -> Self {
        Self {
            env,
            place,
            alone: false,
            awaited: Vec::new(),
        }
    }

    /// The publisher's runner for a job it runs because no task could:
    /// nobody else claims any of it.
    fn caller(env: &'a Arc<Env>) -> Self {
        Self {
            alone: true,
            ..Self::new(env, Place::Publisher)
        }
    }
}

impl<T: Send + Sync + 'static> Runner<T> for TaskModeRunner<'_> {
    /// Never: every runner of a job is started by its publisher.
    fn has_idle_capacity(&self) -> bool {
        false
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        false
    }

    fn claims_rest(&self) -> bool {
        self.alone
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) -> bool {
        match pending::settle(delivery, self.env, self.place, tally) {
            Handed::Away => true,
            Handed::Done => false,
            Handed::Back(future) => {
                self.awaited.push(future);
                false
            }
        }
    }
}
