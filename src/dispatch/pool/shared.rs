//! What a pool's handle and its workers share: one [`Lane`] per worker (the
//! queue engine `TaskPerSubscriber` runs its lanes on), a bell each worker
//! waits on, the flags a worker announces its wait with, the slot showing
//! the work it runs for another to join, and the posted job that wants a
//! helper.
//!
//! # Contract
//! - A worker is its lane's own server (the lane's "task"): a publisher
//!   whose push finds the lane without one rings the worker's bell. The
//!   lane decides that under its lock, and a bell stays rung until its
//!   worker waits, so no push is left queued with its worker asleep.
//! - Every other wake-up that matters is seen: a waker and the worker it
//!   wakes store before they load (`SeqCst`), so one of the two always
//!   sees the other (`Shared::share_rest` with `Shared::stranded_work`,
//!   and `Shared::want_help` with the worker's look at the post).
//! - Publishers waiting for a lane's room (`Overflow::Wait`) are woken by
//!   the lane, once it is down to half (`lane.rs`).
//! - No user data is dropped under a lock here: what a lock held (a job,
//!   a batch) is handed back to the caller to drop after it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cores::Cores;
use super::STALL;
use crate::dispatch::batch::Batch;
use crate::dispatch::lane::{Lane, Pushed, Work};
use crate::dispatch::Fanout;
use crate::sync::{AtomicBool, AtomicUsize, Condvar, Mutex, MutexGuard, Ordering};
use crossbeam_utils::CachePadded;

/// What a worker found to do besides its own lane.
// A share holds its batch by value, moved once per take, as the lane's
// `Work` does: boxing it would cost an allocation per take.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Found<T> {
    /// Help a job a runner is on (its post, or a stalled worker's lone
    /// job).
    Help(Arc<Fanout<T>>),
    /// Join the batch a stalled worker is running.
    Join(Arc<Batch<T>>),
    /// A share of a stalled worker's lane (served once: `Lane::share_done`
    /// when it has run), and that worker.
    Share(Work<T>, usize),
}

/// What the pool's handle and its workers share.
pub(super) struct Shared<T> {
    /// Per worker: its lane.
    pub(super) lanes: Box<[Lane<T>]>,
    /// Per worker: what it waits on when it has nothing to do.
    bells: Box<[CachePadded<Bell>]>,
    /// Per worker: waiting for its bell (or about to). Only the worker
    /// itself sets it; a waker takes it off (see [`Self::take_waiting`]).
    /// Other workers take nothing from a waiting worker's lane: it is about
    /// to take what is there itself.
    pub(super) waiting: Box<[CachePadded<AtomicBool>]>,
    /// Per worker: work it has taken so far. A worker whose count stands
    /// still for [`STALL`] while its lane holds work, or while it runs work
    /// another could join, is stalled.
    pub(super) started: Box<[CachePadded<AtomicUsize>]>,
    /// Per worker: the work it is running that another worker could join
    /// (a batch, or a lone job that claims), for a worker that finds it
    /// stalled. Only the worker itself puts it in or takes it out.
    running: Box<[Running<T>]>,
    /// A job that wants another runner (units left, room for one more): a
    /// worker about to wait takes it instead. Posted by a runner's claim,
    /// taken by whoever looks first; a newer one replaces it (the older
    /// job's own runners still finish it).
    wanted: Mutex<Option<Arc<Fanout<T>>>>,
    /// Per worker: running nothing (looking for work, or waiting for it).
    /// True from the start: a worker not yet started takes what is queued
    /// for it as soon as it does. Only the worker itself changes it.
    pub(super) free: Box<[CachePadded<AtomicBool>]>,
    /// Per worker: running work of its own lane, not another worker's it
    /// helps or took over. Only the worker itself changes it; read for
    /// placement.
    pub(super) runs_own: Box<[CachePadded<AtomicBool>]>,
    /// Which CPU each busy worker runs on, to undo the kernel's stacking
    /// of two on one (`cores.rs`).
    pub(super) cores: Cores,
    /// Workers waiting.
    idle: CachePadded<AtomicUsize>,
    /// Set when the bus starts closing: publishers wait no more (a handler
    /// blocked in `close` may be what they would wait for).
    pub(super) no_waiting: AtomicBool,
    pub(super) stopping: AtomicBool,
    /// Workers now inside an async handler's future that they drive to its
    /// end themselves (the task cap had no slot for it): what that future
    /// waits for may be the very thread a waiting publisher blocks.
    pub(super) driving: AtomicUsize,
}

/// A worker's wake-up: rung by whoever has work for it, and kept rung
/// until the worker waits, so a ring before the wait is not lost.
#[derive(Default)]
struct Bell {
    rung: Mutex<bool>,
    ring: Condvar,
}

impl Bell {
    fn ring(&self) {
        *self.rung.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.ring.notify_one();
    }

    /// Waits until rung (for at most `timeout`, if any), and unrings.
    fn wait(&self, timeout: Option<Duration>) {
        let mut rung = self.rung.lock().unwrap_or_else(|e| e.into_inner());
        if !*rung {
            rung = match timeout {
                Some(timeout) => self.wait_timeout(rung, timeout),
                None => self.ring.wait(rung).unwrap_or_else(|e| e.into_inner()),
            };
        }
        *rung = false;
    }

    #[cfg(not(loom))]
    fn wait_timeout<'a>(
        &'a self,
        rung: MutexGuard<'a, bool>,
        timeout: Duration,
    ) -> MutexGuard<'a, bool> {
        self.ring
            .wait_timeout(rung, timeout)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// Under loom time stands still and a condvar's timed wait never times
    /// out: a yield to the other threads, as if the wait had timed out.
    #[cfg(loom)]
    fn wait_timeout<'a>(
        &'a self,
        rung: MutexGuard<'a, bool>,
        _timeout: Duration,
    ) -> MutexGuard<'a, bool> {
        drop(rung);
        loom::thread::yield_now();
        self.rung.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A worker's slot showing what it runs that another may join.
type Running<T> = CachePadded<Mutex<Option<Joinable<T>>>>;

/// Work a worker runs that another may join.
pub(super) enum Joinable<T> {
    Job(Arc<Fanout<T>>),
    Batch(Arc<Batch<T>>),
}

impl<T> Joinable<T> {
    fn wants_help(&self) -> bool {
        match self {
            Joinable::Job(job) => job.wants_help(),
            Joinable::Batch(batch) => batch.wants_help(),
        }
    }

    /// What joins it.
    fn joined(&self) -> Found<T> {
        match self {
            Joinable::Job(job) => Found::Help(Arc::clone(job)),
            Joinable::Batch(batch) => Found::Join(Arc::clone(batch)),
        }
    }
}

/// A worker's last look at each other worker: its started count then, and
/// when that count was first seen.
pub(super) type Watch = Vec<Option<(usize, Instant)>>;

impl<T: Send + Sync + 'static> Shared<T> {
    /// Queues `job` in `worker`'s lane if it has room; gives back the
    /// lane's take count if not. Rings the worker if its lane had no
    /// server; if the worker is busy (it may be stuck in a slow handler)
    /// and another waits, wakes the other to watch it.
    pub(super) fn push(&self, worker: usize, job: &Arc<Fanout<T>>) -> Result<(), u64> {
        match self.lanes[worker].push(job, false) {
            Pushed::Queued { start_task, .. } => {
                if start_task {
                    self.ring(worker);
                }
                if !self.waiting[worker].load(Ordering::SeqCst) {
                    if let Some(helper) = self.take_waiting(worker) {
                        self.ring(helper);
                    }
                }
                Ok(())
            }
            Pushed::Full { started, .. } => Err(started),
        }
    }

    /// Queues `job` in `worker`'s lane, waiting while it is full
    /// (`Overflow::Wait`). Gives up once the bus is closing, or once the
    /// lane has made no take since it was found full, over a wait of up to
    /// [`STALL`], while a worker drives an async handler's future itself:
    /// the caller then runs
    /// the job itself. That future may wait for what only the publisher's
    /// thread can free (a timer of the runtime the publisher is a thread
    /// of), and waiting on would never end. A worker that is only slow (a
    /// handler that takes milliseconds) is waited for.
    pub(super) fn push_waiting(&self, worker: usize, job: &Arc<Fanout<T>>) -> Result<(), ()> {
        loop {
            let started = match self.push(worker, job) {
                Ok(()) => return Ok(()),
                Err(started) => started,
            };
            if self.no_waiting.load(Ordering::SeqCst) {
                return Err(());
            }
            if !self.lanes[worker].wait_for_progress(started, STALL, &self.no_waiting)
                && self.driving.load(Ordering::SeqCst) > 0
            {
                return Err(());
            }
        }
    }

    /// Whether `worker` runs work of its own or has work queued for it
    /// (for placement: a hint). A worker helping another's publish has
    /// none of its own (`placement.rs`).
    pub(super) fn busy(&self, worker: usize) -> bool {
        self.runs_own[worker].load(Ordering::Relaxed) || self.lanes[worker].is_busy()
    }

    /// Worker `me`, about to run what it took from its own lane, wakes a
    /// waiting worker if work is still queued behind it: the handler it
    /// runs may block, and a worker that looked at this lane while `me`
    /// was still waking up skipped it. With [`Shared::stranded_work`],
    /// looked at after a worker announces its wait, one of the two always
    /// sees the other.
    ///
    /// The same holds for work `me` is about to run that another worker
    /// could join (`joinable`): a handler in it may block the rest.
    pub(super) fn share_rest(&self, me: usize, joinable: bool) {
        if joinable || self.lanes[me].has_queued() {
            if let Some(helper) = self.take_waiting(me) {
                self.ring(helper);
            }
        }
    }

    /// Whether a lane other than `me`'s holds work, or its worker runs
    /// work with units left to claim, while that worker is not waiting (it
    /// is busy, perhaps in a slow handler): looked at by a worker after
    /// announcing its wait, which then watches it instead.
    pub(super) fn stranded_work(&self, me: usize) -> bool {
        (0..self.lanes.len()).any(|other| {
            other != me
                && !self.waiting[other].load(Ordering::SeqCst)
                && (self.lanes[other].has_queued() || self.runs_joinable(other))
        })
    }

    /// Work of another worker that is not waiting, in what it runs or
    /// queued in its lane, for worker `me` (or, `me` out of range, a
    /// `close`'s stand-in): joined or taken if that worker is stalled (or,
    /// for queued work, the pool is stopping), else watched.
    pub(super) fn take_from(
        &self,
        others: impl Iterator<Item = usize>,
        watch: &mut Watch,
    ) -> Elsewhere<T> {
        let stopping = self.stopping.load(Ordering::SeqCst);
        let mut watching = false;
        for other in others {
            let queued = self.lanes[other].has_queued();
            if self.waiting[other].load(Ordering::SeqCst) || !(queued || self.runs_joinable(other))
            {
                // A waiting worker takes its own: what it was woken for must
                // still be there.
                watch[other] = None;
                continue;
            }
            if !stopping && !self.stalled(other, watch) {
                watching = true;
                continue;
            }
            // What its running work has left is held up now; what is
            // queued, after it.
            if let Some(found) = self.joinable(other) {
                return Elsewhere::Took(found);
            }
            if let Some(work) = queued.then(|| self.lanes[other].take_share()).flatten() {
                watch[other] = None;
                return Elsewhere::Took(Found::Share(work, other));
            }
        }
        if watching {
            Elsewhere::Watching
        } else {
            Elsewhere::Nothing
        }
    }

    /// A share of `worker`'s lane has run (`finished` publishes): rings the
    /// worker if its lane has work left and no server.
    pub(super) fn share_done(&self, worker: usize, finished: usize) {
        if self.lanes[worker].share_done(finished) {
            self.ring(worker);
        }
    }

    /// The posted job, if it still wants a runner.
    pub(super) fn take_wanted(&self) -> Option<Arc<Fanout<T>>> {
        let job = self.lock_wanted().take()?;
        if job.wants_help() {
            Some(job)
        } else {
            drop(job); // after the lock: see `want_help`
            None
        }
    }
}

/// What [`Shared::take_from`] found.
#[allow(clippy::large_enum_variant)] // see `Found`
pub(super) enum Elsewhere<T> {
    Took(Found<T>),
    /// Work queued to (or run by) a busy worker that is not stalled (yet).
    Watching,
    /// Nothing anywhere else.
    Nothing,
}

impl<T> Shared<T> {
    /// Takes a worker other than `busy` off the waiting list, if one waits:
    /// the caller rings it. Taking it off first means one ring per wait,
    /// however many publishers see it waiting.
    pub(super) fn take_waiting(&self, busy: usize) -> Option<usize> {
        if self.idle.load(Ordering::SeqCst) == 0 {
            return None;
        }
        // A compare-exchange, not a swap: the flag of a worker that is not
        // waiting is left as it is, so no store races that worker's own
        // announcement (loom orders racing stores by causality alone, and
        // then let a later swap read the flag as false after the worker had
        // set it: a lost wake-up C11 does not allow).
        (0..self.waiting.len()).find(|&worker| {
            worker != busy
                && self.waiting[worker]
                    .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
        })
    }

    /// Wakes `worker` (now, or at its next wait).
    pub(super) fn ring(&self, worker: usize) {
        self.bells[worker].ring();
    }

    /// Worker `me` announces its wait: a waker that looks after this sees
    /// it (see [`Self::take_waiting`]).
    pub(super) fn announce_wait(&self, me: usize) {
        self.waiting[me].store(true, Ordering::SeqCst);
        self.idle.fetch_add(1, Ordering::SeqCst);
    }

    /// Worker `me` waits for its bell (for at most `timeout`, if any).
    pub(super) fn wait(&self, me: usize, timeout: Option<Duration>) {
        self.bells[me].wait(timeout);
    }

    /// Worker `me` no longer waits (rung, or it found work after announcing).
    pub(super) fn end_wait(&self, me: usize) {
        self.idle.fetch_sub(1, Ordering::SeqCst);
        self.waiting[me].store(false, Ordering::SeqCst);
    }

    fn lock_wanted(&self) -> MutexGuard<'_, Option<Arc<Fanout<T>>>> {
        self.wanted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts `job` as wanting a runner and wakes a waiting worker for it.
    /// Returns the job it replaced, for the caller to drop (a job holds a
    /// message, user data whose drop must not run under the lock).
    pub(super) fn want_help(&self, job: &Arc<Fanout<T>>) -> Option<Arc<Fanout<T>>> {
        let replaced = self.lock_wanted().replace(Arc::clone(job));
        // After the post: a worker that set its waiting flag before this
        // load looks at the post after; one that did not is seen here.
        if let Some(worker) = self.take_waiting(usize::MAX) {
            self.ring(worker);
        }
        replaced
    }

    /// Whether any worker runs nothing (a helper would find one).
    pub(super) fn has_free_worker(&self) -> bool {
        self.free.iter().any(|free| free.load(Ordering::Relaxed))
    }

    fn lock_running(&self, worker: usize) -> MutexGuard<'_, Option<Joinable<T>>> {
        self.running[worker]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Shows `work` as what `me` runs (`None`: nothing to join). Returns
    /// what it replaced, for the caller to drop after the lock (a job holds
    /// a message: user data, whose drop must not run under the lock).
    pub(super) fn show_running(&self, me: usize, work: Option<Joinable<T>>) -> Option<Joinable<T>> {
        std::mem::replace(&mut *self.lock_running(me), work)
    }

    /// Whether `worker` runs work with units left to claim.
    fn runs_joinable(&self, worker: usize) -> bool {
        self.lock_running(worker)
            .as_ref()
            .is_some_and(Joinable::wants_help)
    }

    /// What joins the work `worker` runs, if it has units left.
    fn joinable(&self, worker: usize) -> Option<Found<T>> {
        self.lock_running(worker)
            .as_ref()
            .filter(|work| work.wants_help())
            .map(Joinable::joined)
    }

    /// Whether `other` has started nothing for [`STALL`], by `watch`'s last
    /// looks (which this updates).
    fn stalled(&self, other: usize, watch: &mut Watch) -> bool {
        let started = self.started[other].load(Ordering::SeqCst);
        match watch[other] {
            Some((seen, since)) if seen == started => {
                crate::sync::now().duration_since(since) >= STALL
            }
            _ => {
                watch[other] = Some((started, crate::sync::now()));
                false
            }
        }
    }

    /// This pool's name for [`worker_mark`](crate::sync::worker_mark): its
    /// address, which no other live pool shares.
    pub(super) fn key(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    pub(super) fn new(workers: usize, per_worker: usize) -> Self
    where
        T: Send + Sync + 'static,
    {
        let counters = || {
            (0..workers)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect()
        };
        let flags = |value: bool| {
            (0..workers)
                .map(|_| CachePadded::new(AtomicBool::new(value)))
                .collect()
        };
        Self {
            // A lane counts the publishes its servers run; a pool's queue
            // holds `per_worker` beside the one its worker runs.
            lanes: (0..workers)
                .map(|_| Lane::new(per_worker.saturating_add(1)))
                .collect(),
            bells: (0..workers).map(|_| CachePadded::default()).collect(),
            started: counters(),
            running: (0..workers)
                .map(|_| CachePadded::new(Mutex::new(None)))
                .collect(),
            waiting: flags(false),
            free: flags(true),
            runs_own: flags(false),
            cores: Cores::new(workers),
            wanted: Mutex::new(None),
            idle: CachePadded::new(AtomicUsize::new(0)),
            no_waiting: AtomicBool::new(false),
            driving: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        }
    }
}
