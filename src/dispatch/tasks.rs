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
use super::{caller_runs, refused, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::stats::Tally;
use crate::subscriber::BoxFuture;
use crate::sync::{AtomicUsize, Ordering};

/// Counts a bus's live tasks against its cap.
pub(crate) struct TaskGauge {
    live: AtomicUsize,
    cap: usize,
}

impl TaskGauge {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            live: AtomicUsize::new(0),
            cap,
        }
    }

    /// Tasks alive now.
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

/// The right to keep one task alive; released on drop.
pub(crate) struct TaskPermit(Arc<Env>);

impl TaskPermit {
    pub(crate) fn acquire(env: &Arc<Env>) -> Option<Self> {
        let gauge = &env.tasks;
        let mut live = gauge.live.load(Ordering::Relaxed);
        loop {
            if live >= gauge.cap {
                return None;
            }
            match gauge.live.compare_exchange_weak(
                live,
                live + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(Self(Arc::clone(env))),
                Err(now) => live = now,
            }
        }
    }
}

impl Drop for TaskPermit {
    fn drop(&mut self) {
        self.0.tasks.live.fetch_sub(1, Ordering::Relaxed);
    }
}

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
                        let mut runner = PublisherRunner {
                            handle: &self.handle,
                            job: &job,
                            env,
                        };
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
    let task_handle = handle.clone();
    handle.spawn(async move {
        let env = Arc::clone(&permit.0);
        let mut runner = TaskRunner {
            handle: &task_handle,
            job: &job,
            env: &env,
            awaited: Vec::new(),
        };
        let mut tally = Tally::default();
        job.run(&env, &mut runner, &mut tally);
        // Pending deliveries the cap kept from becoming tasks of their own.
        let awaited = std::mem::take(&mut runner.awaited);
        if !awaited.is_empty() {
            pending::finish_here(awaited, &mut tally).await;
        }
        env.counters.add(&tally);
        drop(permit);
    });
}

/// A runner that is a task.
struct TaskRunner<'a, T> {
    handle: &'a Handle,
    job: &'a Arc<Fanout<T>>,
    env: &'a Arc<Env>,
    awaited: Vec<BoxFuture>,
}

impl<T: Send + Sync + 'static> Runner<T> for TaskRunner<'_, T> {
    fn has_idle_capacity(&self) -> bool {
        has_idle_capacity(self.env)
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        offer_helper(self.handle, self.job, self.env)
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        if let Some(future) = pending::settle(delivery, self.env, Place::Task, tally) {
            self.awaited.push(future);
        }
    }
}

/// The publisher, running a unit the cap had no room for.
struct PublisherRunner<'a, T> {
    handle: &'a Handle,
    job: &'a Arc<Fanout<T>>,
    env: &'a Arc<Env>,
}

impl<T: Send + Sync + 'static> Runner<T> for PublisherRunner<'_, T> {
    fn has_idle_capacity(&self) -> bool {
        has_idle_capacity(self.env)
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        offer_helper(self.handle, self.job, self.env)
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        pending::settle(delivery, self.env, Place::Publisher, tally);
    }
}

/// Fewer of the bus's tasks are alive than it has workers: a helper task would
/// likely find a free runtime thread.
fn has_idle_capacity(env: &Env) -> bool {
    env.tasks.live() < env.workers
}

fn offer_helper<T: Send + Sync + 'static>(
    handle: &Handle,
    job: &Arc<Fanout<T>>,
    env: &Arc<Env>,
) -> bool {
    match TaskPermit::acquire(env) {
        Some(permit) => {
            spawn_runner(handle, Arc::clone(job), permit);
            true
        }
        None => false,
    }
}
