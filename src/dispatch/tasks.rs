//! `DeliveryMode::TaskPerSubscriber`: runners are tokio tasks.
//!
//! Each runner of a job is a task spawned on the bus's runtime handle (never
//! on the caller's context). At most `max_inflight_tasks` tasks of the bus —
//! runners and continued async deliveries together — are alive at once; when
//! a runner cannot be spawned the overflow policy applies: `CallerRuns` runs
//! it on the publisher's thread (seed `003`'s "spawn while fewer than Max are
//! running, else run inline"), `Drop` and `Error` count its deliveries as
//! dropped.
//!
//! A runner task runs its units without yielding, like a worker would; it
//! is as long as one chunk of a publish (a single subscription below the
//! threshold).

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
        let mut started = false;
        let mut dropped = 0;
        for _ in 0..job.plan().runners {
            match TaskPermit::acquire(env) {
                Some(permit) => {
                    spawn_runner(&self.handle, Arc::clone(&job), permit);
                    started = true;
                }
                None => match env.overflow {
                    Overflow::CallerRuns => {
                        let mut runner =
                            TaskModeRunner::new(&self.handle, &job, env, Place::Publisher);
                        caller_runs(&job, &mut runner, env);
                    }
                    Overflow::Drop | Overflow::Error => dropped += refused(&job, started, env),
                },
            }
        }
        dropped
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
    let task_handle = handle.clone();
    handle.spawn(async move {
        let env = Arc::clone(task.env());
        let awaited = {
            let mut runner = TaskModeRunner::new(&task_handle, &task.job, &env, Place::Task);
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
struct TaskModeRunner<'a, T> {
    handle: &'a Handle,
    job: &'a Arc<Fanout<T>>,
    env: &'a Arc<Env>,
    place: Place,
    /// Pending deliveries a task runner awaits itself (see `pending.rs`).
    awaited: Vec<BoxFuture>,
}

impl<'a, T> TaskModeRunner<'a, T> {
    fn new(handle: &'a Handle, job: &'a Arc<Fanout<T>>, env: &'a Arc<Env>, place: Place) -> Self {
        Self {
            handle,
            job,
            env,
            place,
            awaited: Vec::new(),
        }
    }
}

impl<T: Send + Sync + 'static> Runner<T> for TaskModeRunner<'_, T> {
    fn has_idle_capacity(&self) -> bool {
        self.env.tasks.live() < self.env.workers
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        let Some(permit) = TaskPermit::acquire(self.env) else {
            return false;
        };
        spawn_runner(self.handle, Arc::clone(self.job), permit);
        if self.place == Place::Task {
            // Spawned from a task, the helper lands in this worker thread's
            // LIFO slot, which other threads never steal and which runs only
            // after this task yields — and this runner may be about to block
            // in a slow handler. A second, empty spawn takes the LIFO slot
            // and pushes the helper into the stealable queue, waking an idle
            // thread to take it.
            self.handle.spawn(async {});
        }
        true
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        if let Some(future) = pending::settle(delivery, self.env, self.place, tally) {
            self.awaited.push(future);
        }
    }
}
