//! `DeliveryMode::TaskPerSubscriber`: runners are tokio tasks.
//!
//! Each runner of a job is a task spawned on the bus's runtime handle (never
//! on the caller's context). At most `max_inflight_tasks` tasks of the bus —
//! runners and continued async deliveries together — are alive at once; when
//! a runner cannot be spawned the overflow policy applies: `CallerRuns` and
//! `Wait` run it on the publisher's thread (seed `003`'s "spawn while fewer
//! than Max are running, else run inline"; a publisher on a runtime thread
//! that waited for tasks could be the thread they need), `Drop` and `Error`
//! count its deliveries as dropped.
//!
//! A runner task runs its units without yielding, like a worker would; it
//! is as long as one chunk of a publish (a single subscription below the
//! threshold).
//!
//! # Every runner is started by the publisher
//! A job whose runners claim from its cursor (`Batch::Chunked`) gets all the
//! runners it may use when it is published: the first always, and up to
//! `max_runners - 1` more while fewer than `workers` of the bus's tasks are
//! alive (a burst already keeps every worker busy, and a runner that finds
//! nothing left to claim is a wasted spawn). Runners never spawn helpers
//! mid-job: a task spawned from inside a runtime worker lands in that
//! thread's LIFO slot, which no other worker steals and which runs only
//! after the spawning task yields, so a helper spawned by a runner stuck in
//! a slow handler would wait behind it. Whether a spawned task runs at once
//! elsewhere is the runtime's business; what this mode relies on is only
//! that runners spawned together may run at once, each taking whatever
//! units are left.

use std::sync::Arc;

use tokio::runtime::Handle;

use super::pending::{self, Place};
use super::permit::TaskPermit;
use super::{caller_runs, refused, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::registry::entry::BoxFuture;
use crate::stats::Tally;

pub(crate) struct Tasks {
    handle: Handle,
}

impl Tasks {
    pub(crate) fn new(handle: Handle) -> Self {
        Self { handle }
    }

    /// Spawns the job's runners; see the module docs for a full cap.
    pub(crate) fn dispatch<T: Send + Sync + 'static>(
        &self,
        job: Arc<Fanout<T>>,
        env: &Arc<Env>,
    ) -> usize {
        let plan = job.plan();
        let mut started = false;
        let mut dropped = 0;
        for _ in 0..plan.runners {
            match TaskPermit::acquire(env) {
                Some(permit) => {
                    spawn_runner(&self.handle, Arc::clone(&job), permit);
                    started = true;
                }
                None => match env.overflow {
                    // A runtime thread that waited for a task slot could be
                    // the one the tasks need: `Wait` runs here too.
                    Overflow::Wait | Overflow::CallerRuns => {
                        let mut runner = TaskModeRunner::new(env, Place::Publisher);
                        caller_runs(&job, &mut runner, env);
                    }
                    Overflow::Drop | Overflow::Error => dropped += refused(&job, started, env),
                },
            }
        }
        if started && !plan.single_claim {
            self.start_more_runners(&job, env);
        }
        dropped
    }

    /// The runners a claiming job may use beyond its first, while workers
    /// look free (see the module docs). A slot the cap refuses is no loss:
    /// the runners already started claim every unit.
    fn start_more_runners<T: Send + Sync + 'static>(&self, job: &Arc<Fanout<T>>, env: &Arc<Env>) {
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
    /// Pending deliveries a task runner awaits itself (see `pending.rs`).
    awaited: Vec<BoxFuture>,
}

impl<'a> TaskModeRunner<'a> {
    fn new(env: &'a Arc<Env>, place: Place) -> Self {
        Self {
            env,
            place,
            awaited: Vec::new(),
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

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        if let Some(future) = pending::settle(delivery, self.env, self.place, tally) {
            self.awaited.push(future);
        }
    }
}
