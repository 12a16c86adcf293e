//! [`Batch`]: publishes to the same subscriptions that a pool worker runs
//! together, subscription by subscription.
//!
//! # Contract
//! - A batch holds consecutive publishes that hold the same deliveries
//!   ([`Fanout::same_chunks`]), each planned for one claiming runner and
//!   not yet seen by any runner. Its jobs are never claimed on their own:
//!   a job runs whole in one batch or by its own claims, never both.
//! - Runners claim **subscriptions** from the batch's one cursor (an atomic
//!   add per claim) and run each claimed subscription's deliveries of every
//!   job back to back, in the jobs' order. So every subscription receives
//!   the publishes in order, whoever runs it. The worker that gathered the
//!   batch runs it; another worker may join it and claim what is left (the
//!   pool lets one join only a worker that has stalled: see `pool.rs`). A
//!   handler that blocks then holds up only the subscriptions claimed with
//!   it, as below the threshold: a claim is one subscription at first and
//!   doubles, up to [`MAX_GRAIN`](super::fanout::MAX_GRAIN), only while
//!   its subscriptions took under [`FAST_UNIT`] per delivery.
//! - An ordered subscription takes its messages of the batch in one turn
//!   ([`Sink::deliver_batch`](crate::registry::entry::Sink)).
//! - Each delivery checks its subscription's flag right before it runs; a
//!   panic is caught, counted, and the walk resumes with the next delivery.
//! - Each runner counts what it claimed (in flight until then, held for
//!   `close` from a handler while it runs it), as a job's runner does.
//!
//! Why whole batches: a fan-out's cost follows the memory it walks, and
//! this walks the entries once per batch instead of once per publish, with
//! each handler's captures still in cache for its next message.

use std::sync::Arc;

use smallvec::SmallVec;

use super::fanout::{Exceptions, Grain, Resumable, SetWalker, FAST_UNIT, MAX_BATCH};
use super::{pending, Env, Fanout, Runner};
use crate::message::Message;
use crate::registry::entry::{Sink, Subscriber, NO_POSITION};
use crate::registry::quiesce;
use crate::stats::Tally;
use crate::sync::{AtomicUsize, Ordering};

/// The jobs of a batch.
pub(crate) type Jobs<T> = SmallVec<[Arc<Fanout<T>>; MAX_BATCH]>;

/// Publishes run together; see the module docs.
pub(crate) struct Batch<T> {
    jobs: Jobs<T>,
    /// The next subscription no runner has claimed (an index into the
    /// first job's deliveries: the jobs' are the same).
    next: AtomicUsize,
}

/// A batch runner's position: delivery `current` of job `job` is next.
struct BatchProgress {
    current: usize,
    /// The end of its current claim.
    claim_end: usize,
    job: usize,
    /// Jobs in the batch: each delivery is one job's at one subscription.
    jobs: usize,
    /// Deliveries it claimed in all.
    claimed: usize,
    exceptions: Exceptions,
    grain: Grain,
}

impl<T> Batch<T> {
    /// The first job (none in an emptied batch).
    pub(crate) fn first(&self) -> Option<&Arc<Fanout<T>>> {
        self.jobs.first()
    }

    /// Drops the jobs (their messages are user data: the caller picks where).
    pub(crate) fn clear(&mut self) {
        self.jobs.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether a runner joining now would find a subscription to claim.
    pub(crate) fn wants_help(&self) -> bool {
        self.jobs
            .first()
            .is_some_and(|first| self.next.load(Ordering::Relaxed) < first.total())
    }
}

impl<T: Send + Sync + 'static> Batch<T> {
    /// The batch of `jobs`; see the module docs for what they must be.
    pub(crate) fn of(jobs: Jobs<T>) -> Self {
        let batch = Self {
            jobs,
            next: AtomicUsize::new(0),
        };
        batch.check();
        batch
    }

    /// Makes this the batch of `jobs`, dropping the jobs it held.
    pub(crate) fn refill(&mut self, jobs: Jobs<T>) {
        self.jobs = jobs;
        self.next = AtomicUsize::new(0);
        self.check();
    }

    fn check(&self) {
        debug_assert!(self
            .jobs
            .iter()
            .all(|job| self.jobs[0].same_chunks(job) && job.has_one_claiming_runner()));
    }

    /// Claims subscriptions and runs their deliveries of every job until
    /// none are left, then adds what it did to `tally`.
    pub(crate) fn run(&self, env: &Env, runner: &mut impl Runner<T>, tally: &mut Tally) {
        let Some(first) = self.jobs.first() else {
            return;
        };
        // Every flag check and handler call of this run happens while present.
        let _present = env.quiescence.enter();
        let mut progress = BatchProgress {
            current: 0,
            claim_end: 0,
            job: 0,
            jobs: self.jobs.len(),
            claimed: 0,
            exceptions: Exceptions::default(),
            grain: Grain::default(),
        };
        first.resuming(&mut progress, tally, |progress, tally| {
            self.work(first, env, runner, progress, tally);
        });
        quiesce::unhold(progress.claimed as u64);
        progress.exceptions.add_to(progress.claimed, tally);
    }

    /// The runner's loop: run the current claim, claim again, until done.
    fn work(
        &self,
        first: &Fanout<T>,
        env: &Env,
        runner: &mut impl Runner<T>,
        p: &mut BatchProgress,
        tally: &mut Tally,
    ) {
        loop {
            if p.current >= p.claim_end && !self.claim(first, p) {
                return;
            }
            self.walk(first, env, runner, p, tally);
        }
    }

    /// Claims the next subscriptions for this runner. False when none are
    /// left.
    fn claim(&self, first: &Fanout<T>, p: &mut BatchProgress) -> bool {
        let per_unit = FAST_UNIT.saturating_mul(p.jobs as u32);
        let units = p.grain.next(per_unit);
        let start = self.next.fetch_add(units, Ordering::Relaxed);
        if start >= first.total() {
            return false;
        }
        let end = (start + units).min(first.total());
        let deliveries = (end - start) * p.jobs;
        p.claimed += deliveries;
        quiesce::hold(deliveries as u64);
        p.current = start;
        p.claim_end = end;
        p.job = 0;
        true
    }

    /// Runs the claim from `p` to its end: each subscription's deliveries
    /// of every job, then the next subscription's.
    #[inline]
    fn walk(
        &self,
        first: &Fanout<T>,
        env: &Env,
        runner: &mut impl Runner<T>,
        p: &mut BatchProgress,
        tally: &mut Tally,
    ) {
        // A slice held in registers: the handler calls are opaque, and the
        // batch (which has atomics) would otherwise be read again for
        // every job.
        let jobs: &[Arc<Fanout<T>>] = &self.jobs;
        let mut sets = SetWalker::new(first.lens());
        while p.current < p.claim_end {
            let (set_index, offset, set_end) = sets.locate(p.current);
            let stop = p.claim_end.min(set_end);
            let set = first.set(set_index);
            // The jobs' messages with their positions in this set's ordered
            // log, for ordered subscriptions to take as one (none if the
            // set has no log).
            let mut ordered = SmallVec::<[(&Arc<Message<T>>, u64); MAX_BATCH]>::new();
            if jobs
                .iter()
                .any(|job| job.position(set_index) != NO_POSITION)
            {
                ordered.extend(
                    jobs.iter()
                        .map(|job| (job.message(), job.position(set_index))),
                );
            }
            for run in set.runs(offset..offset + (stop - p.current)) {
                for slot in run {
                    match slot.get() {
                        Some(entry) => {
                            // Dereferenced once for all the jobs: through the
                            // slot's `Arc`, each delivery would load the slot,
                            // the sink's vtable and its alignment again (the
                            // handler call is opaque to the compiler) before
                            // it could even read the flag; with the address
                            // held, it reads the flag at once. 13-20% less
                            // time per publish on a shared counter (design
                            // notes §13, twenty-sixth session).
                            let entry: &Subscriber<T, dyn Sink<T>> = entry;
                            if p.job == 0
                                && !ordered.is_empty()
                                && entry.is_active()
                                && entry
                                    .sink
                                    .deliver_batch(&ordered, &mut p.exceptions.settled)
                            {
                                p.job = jobs.len();
                            }
                            while let Some(job) = jobs.get(p.job) {
                                if !entry.is_active() {
                                    p.exceptions.not_delivered += 1;
                                    p.job += 1;
                                    continue;
                                }
                                let started = entry.sink.deliver_at(
                                    job.message(),
                                    job.position(set_index),
                                    &mut p.exceptions.settled,
                                );
                                let unfinished = started.and_then(|started| {
                                    pending::first_poll(started, env.handle.as_ref())
                                });
                                p.job += 1;
                                if let Some(future) = unfinished {
                                    p.exceptions.hand_over(future, runner, tally);
                                }
                            }
                        }
                        None => p.exceptions.not_delivered += jobs.len() - p.job,
                    }
                    p.job = 0;
                    p.current += 1;
                }
            }
        }
    }
}

impl Resumable for BatchProgress {
    fn delivery(&self) -> usize {
        self.current
    }

    fn exceptions(&mut self) -> &mut Exceptions {
        &mut self.exceptions
    }

    /// The next job's delivery to the same subscription, or the first
    /// job's to the next.
    fn step_past(&mut self) {
        self.job += 1;
        if self.job == self.jobs {
            self.job = 0;
            self.current += 1;
        }
    }
}
