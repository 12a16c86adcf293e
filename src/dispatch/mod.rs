//! Dispatch: how a matched publish becomes work.
//!
//! - `mod.rs` — the threshold and batching policy ([`Plan`]) and the
//!   dispatcher, shared by every mode.
//! - `fanout.rs` — the per-publish job and the claiming loop runners run.
//! - `tasks.rs` — `TaskPerSubscriber`: runners are tokio tasks, at most
//!   `max_inflight_tasks` alive; a topic's publishes go to its lane, run
//!   by one task at a time, watched by a thread that starts a helper for a
//!   stuck lane.
//! - `lane.rs` — a lane: the bounded queue of publishes a lane's servers
//!   take, in batches, one server at a time. The one queue engine of both
//!   threaded modes: a pool worker is its lane's server, as a lane's task
//!   is in `TaskPerSubscriber`.
//! - `pool/` — `WorkerPool`: runners are jobs in lanes, one per worker
//!   thread; a topic's publishes go to its home worker, and an idle worker
//!   helps a lone publish or takes over from a stalled one.
//! - `placement.rs` — which worker or lane runs a route's publishes: its
//!   home, which moves to an idle one when another route's publishes keep
//!   it busy.
//! - `batch.rs` — publishes queued behind one another to the same
//!   subscriptions, run by a pool worker subscription by subscription (and
//!   joined by another if it stalls).
//! - `inline.rs` — `Inline`: the publisher is the only runner.
//! - `ordered_sink.rs` — sync ordered handlers: delivered by the job like
//!   any handler, one runner at a time per subscription, reading the node's
//!   ordered log.
//! - `ordered.rs` — async ordered handlers: a mailbox and one drain task at
//!   a time per subscription.
//! - `pending.rs` — async handlers whose future is not finished after its
//!   first poll continue as tasks.
//! - `permit.rs` — task slots, counted against `max_inflight_tasks`.
//! - `streams.rs` — stream subscriptions: the publisher pushes into their
//!   mailboxes itself, in every mode.
//!
//! # The policy
//! A publish reaching `n` handler subscriptions (stream subscriptions are
//! pushed to directly by the publisher; see `receiver.rs`) is cut into *units*
//! of work, with threshold `T = max_concurrent_subscriptions`:
//! - `n <= T`: one unit per subscription;
//! - `n > T`, `Batch::Single`: one unit for all `n` (BlazeSub);
//! - `n > T`, `Batch::Chunked`: about one unit per worker, none smaller than
//!   `MIN_CHUNK` subscriptions.
//!
//! *Runners* (a queued job, a task, or the publisher) execute units. Each
//! runner claims the next unit from the job's shared cursor with one atomic
//! add, runs it, and claims again until none are left, so units are never
//! tied to a runner: a slow handler holds up only the runner it is on, and
//! any free runner takes the next unit (below the threshold, cheap handlers
//! are claimed a few at a time, more while the units just run were cheap;
//! see `fanout.rs`).
//! How many runners a job gets:
//! - `Batch::Single` below the threshold: one per unit, each claiming exactly
//!   one — BlazeSub's job per subscriber, and its cost (the cliff the `cliff`
//!   bench reproduces);
//! - `Batch::Chunked` below the threshold: in `WorkerPool`, one, which
//!   enlists a helper runner whenever units remain, fewer than `workers`
//!   runners are on the job, and a worker is idle right now (a job queued
//!   behind another to the same subscriptions runs whole with it, in one
//!   batch: see `batch.rs`); in `TaskPerSubscriber`, the lane's task, which
//!   runs a job queued behind another to the same subscriptions whole with
//!   it, and for a lone publish up to `workers - 1` helper tasks spawned by
//!   the publisher (see `tasks.rs`);
//! - `Batch::Chunked` above the threshold: in `WorkerPool`, one, as below
//!   it, with chunks for units (see `pool/`: a topic's publishes run at
//!   its home worker, so a subscription's deliveries stay on one core,
//!   publish after publish); in `TaskPerSubscriber`, the same as below the
//!   threshold, with chunks for units;
//! - `Batch::Single` above the threshold: one, for the single unit.
//!
//! # Accounting
//! Every delivery handed to a job is in flight until a runner finishes it
//! (delivered, panicked, skipped because its subscription left, or dropped by
//! the overflow policy). Runners add up what they did in a [`Tally`] and
//! publish it to the shared counters once per job, not once per delivery.

mod batch;
mod direct;
mod fanout;
mod inline;
mod lane;
mod lane_watch;
mod ordered;
mod ordered_sink;
mod pending;
mod permit;
mod placement;
mod pool;
mod refused;
mod streams;
mod tasks;

use std::sync::Arc;

use tokio::runtime::Handle;

use crate::config::{Batch, Config, DeliveryMode, Overflow, MIN_CHUNK};
use crate::error::Error;
use crate::panic_message::panic_message;
use crate::registry::quiesce::Quiescence;
use crate::registry::route::Home;
use crate::stats::{Counters, Tally};

pub(crate) use direct::deliver_now;
pub(crate) use fanout::{Fanout, Runner};
pub(crate) use inline::{
    depth as inline_depth, next_depth as next_inline_depth, AtLeast as InlineAtLeast,
    Deeper as InlineDeeper, MAX_INLINE_DEPTH,
};
#[cfg(all(test, loom))]
pub(crate) use lane::{Lane, Next, Pushed, Server};
#[cfg(all(test, loom))]
pub(crate) use lane_watch::LaneWatch;
pub(crate) use ordered::{start_drains, Ordered};
pub(crate) use ordered_sink::OrderedSink;
pub(crate) use pending::publish_in_place;
pub(crate) use permit::TaskGauge;
#[cfg(all(test, loom))]
pub(crate) use pool::STALL;
pub(crate) use streams::push_to_streams;

/// How one publish is cut into units and handed to runners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Deliveries per unit.
    pub(crate) unit: usize,
    /// Runners started by the publisher.
    pub(crate) runners: usize,
    /// The most runners that may work on the job at once.
    pub(crate) max_runners: usize,
    /// Each runner claims one unit and stops (BlazeSub's job per unit).
    pub(crate) single_claim: bool,
}

/// The knobs the policy reads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    threshold: usize,
    batch: Batch,
    workers: usize,
    inline: bool,
}

impl Policy {
    pub(crate) fn new(config: &Config) -> Self {
        Self {
            threshold: config.max_concurrent_subscriptions,
            batch: config.batch,
            workers: config.workers,
            inline: config.delivery == DeliveryMode::Inline,
        }
    }

    /// Whether publishes run inline (`DeliveryMode::Inline`).
    pub(crate) fn is_inline(&self) -> bool {
        self.inline
    }

    pub(crate) fn plan(&self, deliveries: usize) -> Plan {
        let n = deliveries.max(1);
        if self.inline {
            // One runner, the publisher, runs everything: the threshold does
            // not apply.
            return Plan {
                unit: n,
                runners: 1,
                max_runners: 1,
                single_claim: false,
            };
        }
        match (n <= self.threshold, self.batch) {
            (true, Batch::Single) => Plan {
                unit: 1,
                runners: n,
                max_runners: n,
                single_claim: true,
            },
            (true, Batch::Chunked) => Plan {
                unit: 1,
                runners: 1,
                max_runners: n.min(self.workers),
                single_claim: false,
            },
            (false, Batch::Single) => Plan {
                unit: n,
                runners: 1,
                max_runners: 1,
                single_claim: true,
            },
            (false, Batch::Chunked) => {
                let chunks = self.workers.min(n / MIN_CHUNK).max(1);
                Plan {
                    unit: n.div_ceil(chunks),
                    runners: 1,
                    max_runners: chunks,
                    single_claim: false,
                }
            }
        }
    }
}

/// What every runner of a bus shares.
pub(crate) struct Env {
    pub(crate) counters: Arc<Counters>,
    /// Runners announce themselves here, so unsubscribing can wait for them.
    pub(crate) quiescence: Arc<Quiescence>,
    /// `Config::workers`: the parallelism a job may spread over.
    pub(crate) workers: usize,
    pub(crate) handle: Option<Handle>,
    pub(crate) tasks: TaskGauge,
    pub(crate) overflow: Overflow,
}

pub(super) fn report_panic(
    topic: &str,
    subscription: Option<u64>,
    panic: &(dyn std::any::Any + Send),
) {
    tracing::warn!(
        topic,
        subscription,
        panic = panic_message(panic),
        "a subscription handler panicked; the panic was caught and counted"
    );
}

/// How a bus runs its jobs.
pub(crate) enum Dispatcher<T> {
    Tasks(tasks::Tasks<T>),
    Pool(pool::Pool<T>),
    Inline,
}

impl<T: Send + Sync + 'static> Dispatcher<T> {
    pub(crate) fn start(config: &Config, env: &Arc<Env>) -> Result<Self, Error> {
        Ok(match config.delivery {
            DeliveryMode::TaskPerSubscriber => {
                let handle = env.handle.clone().ok_or(Error::NoRuntime {
                    what: "DeliveryMode::TaskPerSubscriber",
                })?;
                Dispatcher::Tasks(tasks::Tasks::start(
                    handle,
                    config.workers,
                    config.max_inflight_tasks,
                    env,
                )?)
            }
            DeliveryMode::WorkerPool => Dispatcher::Pool(pool::Pool::start(
                config.workers,
                config.queue_capacity,
                env,
            )?),
            DeliveryMode::Inline => Dispatcher::Inline,
        })
    }

    /// Hands `job` to runners. Returns how many deliveries were dropped for
    /// lack of room during this call (under `Overflow::Drop` and
    /// `Overflow::Error`); drops that happen later, on a worker, only reach
    /// the counters.
    /// The place (pool worker, task-mode lane) that runs `job`, a publish
    /// to the route with `home`; the route's home may move meanwhile
    /// (`placement.rs`). `Inline`, and `Batch::Single` below the threshold
    /// (its units go to every place in turn), have no place.
    pub(crate) fn place(&self, job: &Fanout<T>, home: &Home) -> usize {
        let plan = job.plan();
        if plan.single_claim && plan.runners > 1 {
            return 0;
        }
        match self {
            Dispatcher::Pool(pool) => pool.place(home),
            Dispatcher::Tasks(tasks) => tasks.place(home),
            Dispatcher::Inline => 0,
        }
    }

    pub(crate) fn dispatch(&self, job: Fanout<T>, env: &Arc<Env>) -> usize {
        match self {
            Dispatcher::Tasks(tasks) => tasks.dispatch(Arc::new(job), env),
            Dispatcher::Pool(pool) => pool.dispatch(Arc::new(job), env),
            Dispatcher::Inline => inline::run(&job, env),
        }
    }

    /// The bus starts closing: publishers stop waiting for room.
    pub(crate) fn closing(&self) {
        match self {
            Dispatcher::Pool(pool) => pool.stop_waiting(),
            Dispatcher::Tasks(tasks) => tasks.closing(),
            Dispatcher::Inline => {}
        }
    }

    /// For a `close` waiting from inside a handler: a step that runs one
    /// piece of work a stalled pool worker is held up on (see
    /// `Pool::stand_in`), returning whether it ran any. Other modes have
    /// none: their handlers hold up no queue.
    pub(crate) fn stand_in<'a>(
        &'a self,
        env: &'a Arc<Env>,
    ) -> Option<impl FnMut() -> bool + Send + 'a> {
        match self {
            Dispatcher::Pool(pool) => pool.stand_in(env),
            Dispatcher::Tasks(_) | Dispatcher::Inline => None,
        }
    }

    /// Whether a request to a route with `home`, made on this thread, runs
    /// its job here (see `Pool::runs_request_here`).
    pub(crate) fn runs_request_here(&self, home: usize) -> bool {
        match self {
            Dispatcher::Pool(pool) => pool.runs_request_here(home),
            Dispatcher::Tasks(_) | Dispatcher::Inline => false,
        }
    }

    /// Stops accepting work once everything queued has run (after `close`).
    pub(crate) fn shut_down(&self) {
        if let Dispatcher::Pool(pool) = self {
            pool.shut_down();
        }
    }
}

/// Runs a job on the publisher's thread because the mode had no room for it
/// (`Overflow::CallerRuns`), with `runner` deciding where helpers and pending
/// async deliveries go.
pub(crate) fn caller_runs<T: Send + Sync + 'static>(
    job: &Fanout<T>,
    runner: &mut impl Runner<T>,
    env: &Env,
) {
    env.counters.caller_ran();
    let mut tally = Tally::default();
    // On the publisher's stack, like an `Inline` job: its handlers'
    // publishes nest (see `MAX_INLINE_DEPTH`).
    let _deeper = inline::Deeper::enter();
    job.run(env, runner, &mut tally);
    env.counters.add(&tally);
}

/// Runs `job` on this thread for a publish made by an async delivery that
/// one of the mode's runners waits for ([`pending::holds_runner_here`]):
/// queued, the job would wait behind that very runner. Once per runner of
/// its plan (`Batch::Single` claims a unit per run), with `runner` making
/// each run's runner, and the mark cleared meanwhile.
pub(crate) fn run_for_held_runner<T: Send + Sync + 'static, R: Runner<T>>(
    job: &Fanout<T>,
    env: &Env,
    mut runner: impl FnMut() -> R,
) {
    pending::run_unmarked(|| {
        for _ in 0..job.plan().runners {
            caller_runs(job, &mut runner(), env);
        }
    });
}

/// Accounts for a runner the mode could not start under `Overflow::Drop` or
/// `Overflow::Error`. `others_started` says whether another runner of the job
/// was started (it will then run every unit this one would have).
pub(crate) fn refused<T: Send + Sync + 'static>(
    job: &Fanout<T>,
    others_started: bool,
    env: &Env,
) -> usize {
    if others_started && !job.plan().single_claim {
        return 0;
    }
    let mut tally = Tally::default();
    let dropped = job.drop_units(&mut tally);
    env.counters.add(&tally);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(threshold: usize, batch: Batch, workers: usize) -> Policy {
        Policy {
            threshold,
            batch,
            workers,
            inline: false,
        }
    }

    #[test]
    fn below_the_threshold_each_subscription_is_a_unit() {
        let single = policy(10, Batch::Single, 4).plan(10);
        assert_eq!(
            (single.unit, single.runners, single.single_claim),
            (1, 10, true)
        );
        let chunked = policy(10, Batch::Chunked, 4).plan(10);
        assert_eq!(
            (chunked.unit, chunked.runners, chunked.max_runners),
            (1, 1, 4)
        );
    }

    #[test]
    fn above_the_threshold_single_is_one_unit_and_chunked_one_per_worker() {
        let single = policy(10, Batch::Single, 4).plan(1000);
        assert_eq!((single.unit, single.runners), (1000, 1));
        let chunked = policy(10, Batch::Chunked, 4).plan(1000);
        assert_eq!(
            (chunked.unit, chunked.runners, chunked.max_runners),
            (250, 1, 4)
        );
    }

    #[test]
    fn inline_ignores_the_threshold() {
        let mut inline = policy(10, Batch::Single, 4);
        inline.inline = true;
        let plan = inline.plan(5);
        assert_eq!((plan.unit, plan.runners, plan.single_claim), (5, 1, false));
    }

    #[test]
    fn chunks_are_never_tiny() {
        let plan = policy(10, Batch::Chunked, 8).plan(40);
        assert_eq!((plan.unit, plan.max_runners), (40, 1));
        let plan = policy(10, Batch::Chunked, 8).plan(64);
        assert_eq!((plan.unit, plan.max_runners), (32, 2));
        let plan = policy(10, Batch::Chunked, 8).plan(11);
        assert_eq!((plan.unit, plan.runners), (11, 1));
    }
}
