//! What a pool's handle and its workers share: one bounded queue of
//! [`Ticket`]s per worker, the counts that admit work to it (room for work
//! only, never taken by a wake-up), the flags a worker announces its wait
//! with, the slot showing the work it runs for another to join, and the
//! posted job that wants a helper.
//!
//! # Contract
//! - A queue admits a work ticket only while its work (queued, or taken
//!   into a batch and not yet run) is under its capacity; wake-ups have
//!   room of their own ([`WAKE_ROOM`]) and take none of the work's.
//! - Every wake-up that matters is seen: a waker and the worker it wakes
//!   store before they load (`SeqCst`), so one of the two always sees the
//!   other (`Shared::share_rest` with `Shared::stranded_work`, and
//!   `Shared::want_help` with the worker's look at the post).
//! - Publishers waiting for a queue's room (`Overflow::Wait`) are woken
//!   only by that queue's worker, once the queue is down to half.
//! - No user data is dropped under a lock here: what a lock held (a job,
//!   a batch) is handed back to the caller to drop after it.

use std::sync::Arc;
use std::time::Instant;

use super::cores::Cores;
use super::STALL;
use crate::dispatch::batch::Batch;
use crate::dispatch::Fanout;
use crate::sync::channel::{self, Receiver, Sender, TrySendError};
use crate::sync::{AtomicBool, AtomicUsize, Condvar, Mutex, MutexGuard, Ordering};
use crossbeam_utils::CachePadded;

/// What a worker takes from a queue, or is handed: work, or a wake-up.
pub(crate) enum Ticket<T> {
    /// A runner of a job, queued by the publisher, so no runner has seen
    /// the job yet.
    Run(Arc<Fanout<T>>),
    /// A helper joining a job a runner is on (its post; never queued).
    Help(Arc<Fanout<T>>),
    /// A worker joining the batch a stalled worker is running (never
    /// queued).
    Join(Arc<Batch<T>>),
    /// Look for work elsewhere, or stop if stopping and there is none.
    Wake,
}

/// What the pool's handle and its workers share.
pub(super) struct Shared<T> {
    /// Work tickets a queue takes (its channel has room for two wake-ups
    /// more, so a wake-up never takes the place of work).
    pub(super) capacity: usize,
    pub(super) queues: Vec<Sender<Ticket<T>>>,
    pub(super) tickets: Vec<Receiver<Ticket<T>>>,
    /// Per queue: wake-ups in it (or about to be). Admission counts work
    /// only: a wake-up can outlive its purpose (its worker found work by
    /// another way and runs it), and while that work runs the stale wake-up
    /// would otherwise take a one-ticket queue's only place.
    pub(super) wakes: Vec<CachePadded<AtomicUsize>>,
    /// Per queue: tickets a worker took from it into a batch and has not run
    /// yet. They keep their room until then, so batching holds no more
    /// publishes than the queue would have. Counted before each is taken.
    pub(super) held: Vec<CachePadded<AtomicUsize>>,
    /// Per worker: waiting on its own empty queue (or about to). Only the
    /// worker itself changes it. Other workers take nothing from a waiting
    /// worker's queue: it is about to take what is there itself.
    pub(super) waiting: Vec<CachePadded<AtomicBool>>,
    /// Per worker: tickets it has taken so far. A worker whose count stands
    /// still for [`STALL`] while work is queued for it is stalled.
    pub(super) started: Vec<CachePadded<AtomicUsize>>,
    /// Per worker: the work it is running that another worker could join
    /// (a batch, or a lone job that claims), for a worker that finds it
    /// stalled. Only the worker itself puts it in or takes it out.
    pub(super) running: Vec<CachePadded<Mutex<Option<Joinable<T>>>>>,
    /// Per worker: a work ticket it took off a queue while gathering a
    /// batch that the ticket did not fit, to run next. Kept here rather
    /// than on the worker's stack so that, if what the worker runs first
    /// blocks, whoever would take the worker's queue takes this first.
    /// Only the worker itself puts one in.
    pub(super) next: Vec<CachePadded<Mutex<Option<Ticket<T>>>>>,
    /// Per worker: whether its `next` holds a ticket, read without the
    /// lock. Changed only under it.
    pub(super) has_next: Vec<CachePadded<AtomicBool>>,
    /// A job that wants another runner (units left, room for one more): a
    /// worker about to wait takes it instead. Posted by a runner's claim,
    /// taken by whoever looks first; a newer one replaces it (the older
    /// job's own runners still finish it).
    pub(super) wanted: Mutex<Option<Arc<Fanout<T>>>>,
    /// Per worker: running nothing (looking for work, or waiting for it).
    /// True from the start: a worker not yet started takes what is queued
    /// for it as soon as it does. Only the worker itself changes it.
    pub(super) free: Vec<CachePadded<AtomicBool>>,
    /// Per worker: running work of its own (taken from its own queue or
    /// its `next`), not another worker's it helps or took over. Only the
    /// worker itself changes it; read for placement.
    pub(super) runs_own: Vec<CachePadded<AtomicBool>>,
    /// Which CPU each busy worker runs on, to undo the kernel's stacking
    /// of two on one (`cores.rs`).
    pub(super) cores: Cores,
    /// Workers waiting.
    pub(super) idle: CachePadded<AtomicUsize>,
    /// Per queue: the publishers waiting for its room (`Overflow::Wait`).
    /// Only that queue's worker wakes them, once the queue is down to half:
    /// a publisher waiting for one queue is not woken by room freed in
    /// another (it would find a slot or two there and wait again, taking a
    /// core from a worker at each wake-up).
    pub(super) room: Vec<CachePadded<RoomWait>>,
    /// Set when the bus starts closing: publishers wait no more (a handler
    /// blocked in `close` may be what they would wait for).
    pub(super) no_waiting: AtomicBool,
    pub(super) stopping: AtomicBool,
    /// Workers now inside an async handler's future that they drive to its
    /// end themselves (the task cap had no slot for it): what that future
    /// waits for may be the very thread a waiting publisher blocks.
    pub(super) driving: AtomicUsize,
}

/// The publishers waiting for one queue's room, and what they wait on.
#[derive(Default)]
pub(super) struct RoomWait {
    pub(super) publishers_waiting: AtomicUsize,
    pub(super) lock: Mutex<()>,
    pub(super) freed: Condvar,
}

impl RoomWait {
    pub(super) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

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

    /// The ticket that joins it.
    fn ticket(&self) -> Ticket<T> {
        match self {
            Joinable::Job(job) => Ticket::Help(Arc::clone(job)),
            Joinable::Batch(batch) => Ticket::Join(Arc::clone(batch)),
        }
    }
}

/// A worker's last look at each other worker: its started count then, and
/// when that count was first seen.
pub(super) type Watch = Vec<Option<(usize, Instant)>>;

impl<T> Shared<T> {
    /// Takes a worker other than `busy` off the waiting list, if one waits:
    /// the caller wakes it. Taking it off first means one wake-up per wait,
    /// however many publishers see it waiting (wake-ups take queue room).
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

    pub(super) fn lock_wanted(&self) -> MutexGuard<'_, Option<Arc<Fanout<T>>>> {
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
            self.wake(worker);
        }
        replaced
    }

    /// Queues a wake-up for `worker`; a full queue needs none (its worker
    /// has work to take).
    pub(super) fn wake(&self, worker: usize) {
        // Counted before it is sent, so taking it never sees the count at
        // zero; meanwhile a publisher may admit one ticket more than the
        // capacity, which the channel's wake-up room holds.
        self.wakes[worker].fetch_add(1, Ordering::SeqCst);
        if self.queues[worker].try_send(Ticket::Wake).is_err() {
            self.wakes[worker].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Notes a ticket taken from `worker`'s queue: a wake-up is uncounted,
    /// and work taken frees room a publisher may wait for.
    pub(super) fn took(&self, worker: usize, ticket: &Ticket<T>) {
        if matches!(ticket, Ticket::Wake) {
            self.wakes[worker].fetch_sub(1, Ordering::SeqCst);
        } else {
            self.freed(worker);
        }
    }

    /// Wakes the waiting publishers if `worker`'s queue is down to half.
    /// Room is freed before the count of waiters is read, and a publisher
    /// counts itself before it looks at the room (both `SeqCst`), so one of
    /// the two sees the other; the waker takes the lock the publisher holds
    /// from its look until it waits, so the wake-up cannot fall between.
    pub(super) fn freed(&self, worker: usize) {
        let room = &self.room[worker];
        if room.publishers_waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let used = self.queued_work(worker) + self.held[worker].load(Ordering::SeqCst);
        if used <= self.capacity / 2 {
            let _lock = room.lock();
            room.freed.notify_all();
        }
    }

    /// Whether `worker` runs work of its own or has work queued for it
    /// (for placement: a hint, read without ordering). A worker helping
    /// another's publish has none of its own (`placement.rs`).
    pub(super) fn busy(&self, worker: usize) -> bool {
        self.runs_own[worker].load(Ordering::Relaxed)
            || self.queued_work(worker) > 0
            || self.has_next(worker)
    }

    /// Whether `worker`'s queue takes another work ticket.
    pub(super) fn has_room(&self, worker: usize) -> bool {
        let wakes = self.wakes[worker].load(Ordering::SeqCst);
        let held = self.held[worker].load(Ordering::SeqCst);
        self.queues[worker].len().saturating_sub(wakes) + held < self.capacity
    }

    /// Work tickets queued for `worker`, never more than there are (a
    /// wake-up is counted before it is sent and uncounted after it is
    /// taken, so a count read meanwhile is at worst one short).
    pub(super) fn queued_work(&self, worker: usize) -> usize {
        let wakes = self.wakes[worker].load(Ordering::SeqCst);
        self.queues[worker].len().saturating_sub(wakes)
    }

    /// Worker `me`, about to run what it took from its own queue, wakes a
    /// waiting worker if work is still queued behind it: the handler it
    /// runs may block, and a worker that looked at this queue while `me`
    /// was still waking up (or while a wake-up was being taken from it)
    /// skipped it. With [`Shared::stranded_work`], looked at after a worker
    /// announces its wait, one of the two always sees the other.
    ///
    /// The same holds for work `me` is about to run that another worker
    /// could join (`joinable`), and for a ticket in its `next`: a handler
    /// in what it runs first may block the rest.
    pub(super) fn share_rest(&self, me: usize, joinable: bool) {
        if joinable || self.queued_work(me) > 0 || self.has_next(me) {
            if let Some(helper) = self.take_waiting(me) {
                self.wake(helper);
            }
        }
    }

    /// Whether a queue other than `me`'s holds work (or its worker's
    /// `next` does), or its worker runs work with units left to claim,
    /// while that worker is not
    /// waiting (it is busy, perhaps in a slow handler): looked at by a
    /// worker after announcing its wait, which then watches it instead.
    pub(super) fn stranded_work(&self, me: usize) -> bool {
        (0..self.queues.len()).any(|other| {
            other != me
                && !self.waiting[other].load(Ordering::SeqCst)
                && (self.queued_work(other) > 0
                    || self.has_next(other)
                    || self.runs_joinable(other))
        })
    }

    /// Puts `ticket` in worker `me`'s `next` (empty: `me` takes what it
    /// put there before gathering again).
    pub(super) fn put_next(&self, me: usize, ticket: Ticket<T>) {
        let mut next = self.next[me].lock().unwrap_or_else(|e| e.into_inner());
        let replaced = next.replace(ticket);
        self.has_next[me].store(true, Ordering::SeqCst);
        drop(next);
        // None by construction; were it not, its job (a message: user data)
        // is dropped here, after the lock, as everywhere in this file.
        drop(replaced);
    }

    /// Whether `worker`'s `next` holds a ticket.
    pub(super) fn has_next(&self, worker: usize) -> bool {
        self.has_next[worker].load(Ordering::SeqCst)
    }

    /// Takes the ticket in `worker`'s `next`, if any.
    pub(super) fn take_next(&self, worker: usize) -> Option<Ticket<T>> {
        if !self.has_next(worker) {
            return None;
        }
        let mut next = self.next[worker].lock().unwrap_or_else(|e| e.into_inner());
        self.has_next[worker].store(false, Ordering::SeqCst);
        next.take()
    }

    pub(super) fn lock_running(&self, worker: usize) -> MutexGuard<'_, Option<Joinable<T>>> {
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
    pub(super) fn runs_joinable(&self, worker: usize) -> bool {
        self.lock_running(worker)
            .as_ref()
            .is_some_and(Joinable::wants_help)
    }

    /// A ticket joining the work `worker` runs, if it has units left.
    pub(super) fn joinable(&self, worker: usize) -> Option<Ticket<T>> {
        self.lock_running(worker)
            .as_ref()
            .filter(|work| work.wants_help())
            .map(Joinable::ticket)
    }

    /// Gives back the room of `tickets` held from `worker`'s queue.
    pub(super) fn release(&self, worker: usize, tickets: usize) {
        if tickets > 0 {
            self.held[worker].fetch_sub(tickets, Ordering::SeqCst);
            self.freed(worker);
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

    /// Queues `ticket` for `worker`; if that worker is busy (it may be
    /// stuck in a slow handler) and another waits, wakes the other to watch
    /// it.
    pub(super) fn push(&self, worker: usize, ticket: Ticket<T>) -> Result<(), Ticket<T>> {
        if !self.has_room(worker) {
            return Err(ticket);
        }
        match self.queues[worker].try_send(ticket) {
            Ok(()) => {}
            Err(TrySendError::Full(ticket) | TrySendError::Disconnected(ticket)) => {
                return Err(ticket)
            }
        }
        if !self.waiting[worker].load(Ordering::SeqCst) {
            if let Some(helper) = self.take_waiting(worker) {
                self.wake(helper);
            }
        }
        Ok(())
    }

    /// Queues `ticket` for `worker`, waiting while its queue is full
    /// (`Overflow::Wait`). Gives the ticket back once the bus is closing, or
    /// once the worker has started nothing for a whole [`STALL`] of the
    /// wait while a worker drives an async handler's future itself: the
    /// caller then runs it itself. That future may wait for what only the
    /// publisher's thread can free (a timer of the runtime the publisher is
    /// a thread of), and waiting on would never end. A worker that is only
    /// slow (a handler that takes milliseconds) is waited for.
    pub(super) fn push_waiting(
        &self,
        worker: usize,
        mut ticket: Ticket<T>,
    ) -> Result<(), Ticket<T>> {
        loop {
            ticket = match self.push(worker, ticket) {
                Ok(()) => return Ok(()),
                Err(ticket) => ticket,
            };
            if self.no_waiting.load(Ordering::SeqCst) {
                return Err(ticket);
            }
            let started = self.started[worker].load(Ordering::SeqCst);
            let room = &self.room[worker];
            let lock = room.lock();
            room.publishers_waiting.fetch_add(1, Ordering::SeqCst);
            let (lock, timed_out) =
                if self.has_room(worker) || self.no_waiting.load(Ordering::SeqCst) {
                    (lock, false)
                } else {
                    let (lock, waited) = room
                        .freed
                        .wait_timeout(lock, STALL)
                        .unwrap_or_else(|e| e.into_inner());
                    (lock, waited.timed_out())
                };
            room.publishers_waiting.fetch_sub(1, Ordering::SeqCst);
            drop(lock);
            if timed_out
                && self.started[worker].load(Ordering::SeqCst) == started
                && self.driving.load(Ordering::SeqCst) > 0
            {
                return Err(ticket);
            }
        }
    }

    /// Whether `other` has started nothing for [`STALL`], by `watch`'s last
    /// looks (which this updates).
    pub(super) fn stalled(&self, other: usize, watch: &mut Watch) -> bool {
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
}

impl<T> Shared<T> {
    /// This pool's name for [`worker_mark`](crate::sync::worker_mark): its
    /// address, which no other live pool shares.
    pub(super) fn key(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    pub(super) fn new(workers: usize, per_worker: usize) -> Self {
        let (queues, tickets) = (0..workers)
            .map(|_| channel::bounded(per_worker.saturating_add(WAKE_ROOM)))
            .unzip();
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
            capacity: per_worker,
            queues,
            tickets,
            wakes: counters(),
            held: counters(),
            started: counters(),
            running: (0..workers)
                .map(|_| CachePadded::new(Mutex::new(None)))
                .collect(),
            next: (0..workers)
                .map(|_| CachePadded::new(Mutex::new(None)))
                .collect(),
            has_next: flags(false),
            waiting: flags(false),
            free: flags(true),
            runs_own: flags(false),
            cores: Cores::new(workers),
            wanted: Mutex::new(None),
            idle: CachePadded::new(AtomicUsize::new(0)),
            room: (0..workers).map(|_| CachePadded::default()).collect(),
            no_waiting: AtomicBool::new(false),
            driving: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        }
    }
}

/// Room each queue keeps beyond its work tickets, for wake-ups.
const WAKE_ROOM: usize = 2;
