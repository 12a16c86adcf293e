//! [`Batch`]: publishes to the same subscriptions that a pool worker runs
//! together, subscription by subscription.
//!
//! # Contract
//! - A batch holds consecutive publishes that hold the same deliveries
//!   ([`Fanout::same_chunks`]), each planned for one claiming runner and
//!   not yet seen by any runner. Its jobs are never claimed on their own:
//!   a job runs whole in one batch or by its own claims, never both.
//! - Runners claim **subscriptions** from the batch's one cursor (an atomic
//!   add per claim) and run the claimed ones in groups of up to [`GROUP`]
//!   consecutive subscriptions: the first job's deliveries to the group,
//!   then the next job's, in the jobs' order. So every subscription
//!   receives the publishes in order, whoever runs it. The worker that
//!   gathered the batch runs it; another worker may join it and claim what
//!   is left (the
//!   pool lets one join only a worker that has stalled: see `pool/`). A
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
//! each handler's captures still in cache for its next message. Why groups:
//! one subscription at a time, a delivery read the job (its message and
//! log position) from a batch-wide list of up to 64 jobs every time; a
//! group reads each job once for up to eight deliveries, and its entries
//! stay in cache meanwhile (design notes §13, twenty-sixth session).

use std::sync::Arc;

use smallvec::SmallVec;

use super::fanout::{
    self, start, Exceptions, Grain, Member, Resumable, SetWalker, FAST_UNIT, MAX_BATCH,
};
use super::{Env, Fanout, Runner};
use crate::message::Message;
use crate::registry::entry::NO_POSITION;
use crate::registry::quiesce;
use crate::stats::Tally;
use crate::sync::{AtomicUsize, Ordering};

/// Subscriptions a runner walks together, job by job: their entries stay
/// in the core's first-level cache across the batch's jobs, and each job's
/// message is read once per group rather than once per delivery.
const GROUP: usize = 8;

/// The jobs of a batch.
pub(crate) type Jobs<T> = SmallVec<[Arc<Fanout<T>>; MAX_BATCH]>;

/// Publishes run together; see the module docs.
pub(crate) struct Batch<T> {
    jobs: Jobs<T>,
    /// The next subscription no runner has claimed (an index into the
    /// first job's deliveries: the jobs' are the same).
    next: AtomicUsize,
}

/// A batch runner's position: the delivery of job `job` to subscription
/// `current + member` is next.
struct BatchProgress {
    /// The first subscription of the group in progress (or of the next).
    current: usize,
    /// The end of its current claim.
    claim_end: usize,
    /// The job whose deliveries to the group are in progress.
    job: usize,
    /// Within the group, the subscription whose delivery of `job` is next.
    member: usize,
    /// Subscriptions in the group in progress.
    group: usize,
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

    /// Its jobs, for a batch of another allocation.
    pub(crate) fn into_jobs(self) -> Jobs<T> {
        self.jobs
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
            member: 0,
            group: 1,
            jobs: self.jobs.len(),
            claimed: 0,
            exceptions: Exceptions::default(),
            grain: Grain::default(),
        };
        first.resuming(&mut progress, tally, |progress, tally| {
            self.work(first, env, runner, progress, tally);
        });
        progress.exceptions.unhold_rest(env, progress.claimed);
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
            if p.current >= p.claim_end && !self.claim(first, env, p) {
                return;
            }
            self.walk(first, env, runner, p, tally);
        }
    }

    /// Claims the next subscriptions for this runner. False when none are
    /// left.
    fn claim(&self, first: &Fanout<T>, env: &Env, p: &mut BatchProgress) -> bool {
        // A one-worker pool: no other worker can join (a `close`'s
        // stand-in could, but it would find nothing), so all of it at once. A
        // handler that blocks on `close` then holds up the rest of the
        // batch as held by this thread's stack (see `quiesce::held_here`),
        // not unclaimed work `close` would wait for until its timeout.
        let units = if env.workers == 1 {
            first.total()
        } else {
            p.grain.next(FAST_UNIT.saturating_mul(p.jobs as u32))
        };
        let start = self.next.fetch_add(units, Ordering::Relaxed);
        if start >= first.total() {
            return false;
        }
        let end = (start + units).min(first.total());
        let deliveries = (end - start) * p.jobs;
        p.claimed += deliveries;
        quiesce::hold(&env.quiescence, deliveries as u64);
        p.current = start;
        p.claim_end = end;
        p.job = 0;
        p.member = 0;
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
            // Ordered subscriptions take a batch in one turn, one by one;
            // the others in groups.
            let group_size = if ordered.is_empty() { GROUP } else { 1 };
            for run in set.runs(offset..offset + (stop - p.current)) {
                for group in run.chunks(group_size) {
                    p.group = group.len();
                    // Dereferenced once for all the jobs, flag and sink:
                    // through the slot's `Arc`, each delivery would load
                    // the slot, the sink's vtable and its alignment again
                    // (the handler call is opaque to the compiler) before
                    // it could even read the flag.
                    let mut members: [Member<'_, T>; GROUP] = [None; GROUP];
                    for (member, slot) in members.iter_mut().zip(group) {
                        *member = fanout::member(slot);
                    }
                    let members = &members[..group.len()];
                    if let [Some((entry, sink))] = *members {
                        if p.job == 0
                            && !ordered.is_empty()
                            && entry.is_active()
                            && sink.deliver_batch(&ordered, &mut p.exceptions.settled)
                        {
                            p.job = jobs.len();
                        }
                    }
                    // The walk's place, kept in registers (see `start`).
                    let mut job_index = p.job;
                    let mut from = p.member;
                    while let Some(job) = jobs.get(job_index) {
                        let message = job.message();
                        let position = job.position(set_index);
                        for (offset, member) in members[from..].iter().enumerate() {
                            let Some((_, sink)) = member.filter(|(entry, _)| entry.is_active())
                            else {
                                // Unsubscribed since the publish.
                                p.exceptions.not_delivered += 1;
                                continue;
                            };
                            let started =
                                start(sink, message, position, env, &mut p.exceptions.settled);
                            if !matches!(started, Ok(None)) {
                                p.job = job_index;
                                p.member = from + offset;
                                let delivery = p.current + p.member;
                                p.exceptions
                                    .unfinished(started, first, delivery, runner, env, tally);
                            }
                        }
                        from = 0;
                        job_index += 1;
                    }
                    p.member = 0;
                    p.job = 0;
                    p.current += group.len();
                }
            }
        }
    }
}

impl Resumable for BatchProgress {
    fn delivery(&self) -> usize {
        self.current + self.member
    }

    fn exceptions(&mut self) -> &mut Exceptions {
        &mut self.exceptions
    }

    /// The same job's delivery to the group's next subscription, or the
    /// next job's to the group's first, or the first job's to the next
    /// group.
    fn step_past(&mut self) {
        self.member += 1;
        if self.member < self.group {
            return;
        }
        self.member = 0;
        self.job += 1;
        if self.job == self.jobs {
            self.job = 0;
            self.current += self.group;
        }
    }
}
