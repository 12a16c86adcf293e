//! [`Lane`]: the publishes of some routes, queued and run in order by one
//! server at a time: the queue engine of both threaded modes. In
//! `TaskPerSubscriber` the lane's task is a tokio task (`tasks.rs`); in
//! `WorkerPool` it is the lane's worker thread, started by a ring of its
//! bell instead of a spawn (`pool/`).
//!
//! # Contract
//! - A route's publishes go to lane `home % lanes` (`registry/route.rs`:
//!   routes get homes in turn). One topic's
//!   publishes then run one after another in one place, so handlers that
//!   share state do not fight over it between cores; two busy topics run
//!   in two lanes.
//! - A lane holds at most `capacity` publishes, queued or taken by a server
//!   or a share and not yet run. Only the caller decides
//!   what a full lane means (wait, run, drop: see `tasks.rs`).
//! - *Servers* take work from the head of the queue: the lane's task
//!   (spawned when work arrives and none is alive; at most one), and, in
//!   `TaskPerSubscriber`, others — a publisher that finds the lane full
//!   and nobody serving it, or one that waited for a server that has
//!   started nothing for [`STALL`](super::pool::STALL). A lane's task that
//!   starts while
//!   another server is on the lane leaves at once; that server starts a
//!   task when it leaves with work still queued. So queued work always has
//!   a server or a task on its way, and one lane's handlers run in one
//!   place unless its server stalls.
//! - A *share* is taken once, beside or instead of a stalled server (a pool
//!   worker taking over, a `close`'s stand-in): at most half of what is
//!   queued after the head. Its taker is no server: the lane's task stays
//!   started for the rest (a lane with work queued always has its task
//!   started or a server on it).
//! - A server takes the consecutive publishes at the head that hold the
//!   same deliveries (a burst to one topic), up to [`MAX_BATCH`], as one
//!   [`Batch`]: the subscriptions are walked once for all of them. A
//!   publish that helper runners were started for (a lone publish, see
//!   `tasks.rs`) runs by its own claims, never in a batch.
//! - No user code runs under the lane's lock: work is taken out under it
//!   and run, and dropped, after.
//! - Publishers waiting for room are woken when a server or a share
//!   finishes work and leaves the lane at half its capacity or less, when
//!   the last server leaves it, and when the bus closes; otherwise their
//!   wait ends after the `stall` they gave.

use std::collections::VecDeque;
use std::sync::Arc;

use super::batch::{Batch, Jobs};
use super::fanout::MAX_BATCH;
use super::{Env, Fanout, Runner};
use crate::stats::Tally;
use crate::sync::{AtomicBool, Condvar, Mutex, MutexGuard, Ordering};

/// One lane; see the module docs.
pub(crate) struct Lane<T> {
    capacity: usize,
    state: Mutex<State<T>>,
    room: Condvar,
}

struct Queued<T> {
    job: Arc<Fanout<T>>,
    /// Helper runners may be on it: it runs by its own claims.
    helped: bool,
}

struct State<T> {
    queue: VecDeque<Queued<T>>,
    /// The lane's task is spawned and has not left.
    task: bool,
    /// Servers taking work from the queue now (a task paused between two
    /// takes, to await or to yield, is not one).
    serving: usize,
    /// Takes so far: a waiting publisher that sees no new one for
    /// [`STALL`](super::pool::STALL) finds the lane's server stalled.
    started: u64,
    /// Publishers waiting for room.
    waiting: usize,
    /// Publishes servers took and have not finished: they keep their room
    /// until then, so servers stuck beside each other hold no more than
    /// the lane would.
    held: usize,
    /// Helper tasks started and not yet serving: the watcher starts no
    /// other meanwhile.
    coming: usize,
}

impl<T> State<T> {
    /// The room taken: queued publishes and those servers hold.
    fn used(&self) -> usize {
        self.queue.len() + self.held
    }
}

/// What a server takes from the lane at once.
// A batch is moved once per take (of up to `MAX_BATCH` publishes); boxing
// it would cost an allocation per take instead.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Work<T> {
    Job(Arc<Fanout<T>>),
    Batch(Batch<T>),
}

impl<T: Send + Sync + 'static> Work<T> {
    /// The publishes it holds.
    pub(crate) fn publishes(&self) -> usize {
        match self {
            Work::Job(_) => 1,
            Work::Batch(batch) => batch.len(),
        }
    }

    pub(crate) fn run(&self, env: &Env, runner: &mut impl Runner<T>, tally: &mut Tally) {
        match self {
            Work::Job(job) => job.run(env, runner, tally),
            Work::Batch(batch) => batch.run(env, runner, tally),
        }
    }
}

/// The outcome of [`Lane::push`].
pub(crate) enum Pushed {
    /// Queued. `start_task`: the caller must start the lane's task (it is
    /// counted as started). `lone`: nothing was queued or served before it,
    /// and it may take helper runners (it was marked to run by its own
    /// claims).
    Queued { start_task: bool, lone: bool },
    /// The lane is full; `serving` servers are on it, and `started` takes
    /// were made so far.
    Full { serving: usize, started: u64 },
}

/// The outcome of [`Lane::next`].
#[allow(clippy::large_enum_variant)] // see `Work`
pub(crate) enum Next<T> {
    Work(Work<T>),
    /// The server has left the lane. `start_task`: work is left and no task
    /// is alive; the caller must start one (it is counted as started).
    Left {
        start_task: bool,
    },
}

/// Who serves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Server {
    /// The lane's task.
    Task,
    /// A publisher (or anyone else) serving the lane for a while.
    Other,
}

impl<T> Lane<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a server runs something or publishes are queued (for
    /// placement).
    pub(crate) fn is_busy(&self) -> bool {
        let state = self.lock();
        state.used() > 0 || state.serving > 0
    }

    /// Whether publishes are queued (not counting those servers took).
    pub(crate) fn has_queued(&self) -> bool {
        !self.lock().queue.is_empty()
    }

    /// Wakes every publisher waiting for room (the bus is closing).
    pub(crate) fn wake_waiting(&self) {
        let _state = self.lock();
        self.room.notify_all();
    }
}

impl<T: Send + Sync + 'static> Lane<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            state: Mutex::new(State {
                queue: VecDeque::new(),
                task: false,
                serving: 0,
                started: 0,
                waiting: 0,
                coming: 0,
                held: 0,
            }),
            room: Condvar::new(),
        }
    }

    /// The publishes it holds at most.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The takes made so far, if publishes are queued: a watcher that sees
    /// the same count twice, [`STALL`] apart, finds the lane stuck (its
    /// server in a slow handler, or its task not run yet).
    ///
    /// [`STALL`]: super::pool::STALL
    /// `None` too while a helper is on its way.
    pub(crate) fn stuck_look(&self) -> Option<u64> {
        let state = self.lock();
        (!state.queue.is_empty() && state.coming == 0).then_some(state.started)
    }

    /// A helper task is being started (see [`Self::stuck_look`]).
    pub(crate) fn helper_coming(&self) {
        self.lock().coming += 1;
    }

    /// A helper task begins to serve.
    pub(crate) fn helper_begins(&self) {
        let mut state = self.lock();
        state.coming -= 1;
        state.serving += 1;
    }

    /// A helper task will never serve again (its runtime dropped it;
    /// `begun`: after it had begun). With nobody serving and no task, the
    /// queued publishes are handed back for the caller to count as dropped.
    pub(crate) fn helper_gone(&self, begun: bool) -> Vec<Arc<Fanout<T>>> {
        let mut state = self.lock();
        if !begun {
            state.coming -= 1;
        }
        if state.serving > 0 || state.task {
            return Vec::new();
        }
        state.queue.drain(..).map(|queued| queued.job).collect()
    }

    /// The room taken now: queued publishes and those servers hold.
    #[cfg(all(test, loom))]
    pub(crate) fn room_used(&self) -> usize {
        self.lock().used()
    }

    /// Whether the lane's task is spawned and has not left.
    #[cfg(all(test, loom))]
    pub(crate) fn has_task(&self) -> bool {
        self.lock().task
    }

    /// Queues `job` if the lane has room. A lone publish that may take
    /// helpers (`helpable`) is marked to run by its own claims.
    pub(crate) fn push(&self, job: &Arc<Fanout<T>>, helpable: bool) -> Pushed {
        let mut state = self.lock();
        if state.used() >= self.capacity {
            return Pushed::Full {
                serving: state.serving,
                started: state.started,
            };
        }
        let lone = state.queue.is_empty() && state.serving == 0;
        state.queue.push_back(Queued {
            job: Arc::clone(job),
            helped: lone && helpable,
        });
        let start_task = !state.task;
        state.task = true;
        Pushed::Queued {
            start_task,
            lone: lone && helpable,
        }
    }

    /// Waits until the lane has room, its servers make no take for
    /// `stall`, or nobody serves it. Returns whether it is worth pushing
    /// again without serving: `false` when the lane's servers seem stalled
    /// (`started` takes when the caller found it full, and none since).
    pub(crate) fn wait_for_room(&self, started: u64, stall: std::time::Duration) -> bool {
        let state = self.lock();
        if state.used() < self.capacity || state.serving == 0 {
            return true;
        }
        let state = self.wait_as_publisher(state, stall);
        state.used() < self.capacity || state.serving == 0 || state.started != started
    }

    /// Waits on the lane's room for at most `stall`, counted among the
    /// waiting publishers meanwhile (a take wakes them at half the lane).
    fn wait_as_publisher<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<T>>,
        stall: std::time::Duration,
    ) -> MutexGuard<'a, State<T>> {
        state.waiting += 1;
        let (mut state, _) = self
            .room
            .wait_timeout(state, stall)
            .unwrap_or_else(|e| e.into_inner());
        state.waiting -= 1;
        state
    }

    /// Waits for at most `stall` to be woken (see the module docs) while
    /// the lane is full, even while nobody serves it (a pool's lane, whose
    /// worker is on its way), unless `no_waiting` is set: it is read under
    /// the lane's lock, which [`Self::wake_waiting`] takes to wake the
    /// waiters after setting it, so the wake-up cannot fall between the
    /// look and the wait. Returns whether room or a take came: `false`
    /// when the lane made no take since `started` (the count when the
    /// caller found it full) and is still full.
    pub(crate) fn wait_for_progress(
        &self,
        started: u64,
        stall: std::time::Duration,
        no_waiting: &AtomicBool,
    ) -> bool {
        let state = self.lock();
        if state.used() < self.capacity || state.started != started {
            return true;
        }
        if no_waiting.load(Ordering::SeqCst) {
            return false;
        }
        let state = self.wait_as_publisher(state, stall);
        state.used() < self.capacity || state.started != started
    }

    /// A pool's worker, the lane's task, looks at its lane: it begins to
    /// serve (true) if it was started (a push found the lane without it)
    /// and nobody else serves the lane. Otherwise it has left, as a task
    /// that begins beside another server does (see
    /// [`Self::task_begins`]): that server starts it again when it leaves
    /// with work still queued, and with nothing queued there is nothing to
    /// start it for.
    pub(crate) fn worker_begins(&self) -> bool {
        let mut state = self.lock();
        if !state.task {
            return false;
        }
        if state.serving > 0 || state.queue.is_empty() {
            state.task = false;
            return false;
        }
        state.serving += 1;
        true
    }

    /// Takes a share of the lane for one who takes from it once, beside or
    /// instead of a stalled server (a pool worker taking over, a `close`'s
    /// stand-in): the head's work, of at most half of what is queued after
    /// the head (work stealing's rule: the owner keeps the rest). A share
    /// holds its room until [`Self::share_done`], but its taker is no
    /// server: the lane's own server still serves the rest.
    pub(crate) fn take_share(&self) -> Option<Work<T>> {
        let mut state = self.lock();
        if state.queue.is_empty() {
            return None;
        }
        let limit = 1 + (state.queue.len() - 1) / 2;
        let work = take(&mut state.queue, limit);
        state.held += work.publishes();
        state.started += 1;
        Some(work)
    }

    /// A share taken with [`Self::take_share`] has run (`finished`
    /// publishes). Returns whether the lane's task must be started (work is
    /// left and nobody serves it; it is counted as started).
    pub(crate) fn share_done(&self, finished: usize) -> bool {
        let mut state = self.lock();
        self.finished(&mut state, finished);
        let start_task = !state.queue.is_empty() && !state.task && state.serving == 0;
        if start_task {
            state.task = true;
        }
        start_task
    }

    /// The lane's task begins to serve: `false` if another server is on the
    /// lane, and the task has left (see the module docs).
    pub(crate) fn task_begins(&self) -> bool {
        let mut state = self.lock();
        if state.serving > 0 {
            state.task = false;
            return false;
        }
        state.serving += 1;
        true
    }

    /// A server other than the lane's task begins to serve.
    pub(crate) fn other_begins(&self) {
        self.lock().serving += 1;
    }

    /// The next work for a server that has `finished` the publishes of its
    /// last work, while more than `until` publishes are queued (the lane's
    /// task serves until none are); otherwise the server leaves.
    pub(crate) fn next(&self, server: Server, until: usize, finished: usize) -> Next<T> {
        let mut state = self.lock();
        self.finished(&mut state, finished);
        if state.queue.len() > until {
            let work = take(&mut state.queue, MAX_BATCH);
            state.held += work.publishes();
            state.started += 1;
            return Next::Work(work);
        }
        Next::Left {
            start_task: self.leave(&mut state, server),
        }
    }

    /// A server has `finished` the publishes of its last work: their room
    /// is free.
    fn finished(&self, state: &mut State<T>, finished: usize) {
        state.held -= finished;
        if state.waiting > 0 && state.used() <= self.capacity / 2 {
            self.room.notify_all();
        }
    }

    /// `server` leaves the lane. Returns whether the caller must start the
    /// lane's task (it is counted as started).
    fn leave(&self, state: &mut State<T>, server: Server) -> bool {
        state.serving -= 1;
        let start_task = match server {
            Server::Task => {
                state.task = false;
                false
            }
            Server::Other => !state.queue.is_empty() && !state.task,
        };
        if start_task {
            state.task = true;
        }
        if state.waiting > 0 && state.serving == 0 {
            // They find nobody serving and serve themselves.
            self.room.notify_all();
        }
        start_task
    }

    /// A server pauses between two takes (the lane's task to await or to
    /// yield, another to await).
    /// Waiting publishers are not woken: a yield is over in microseconds,
    /// and one that waits longer finds the lane stalled after
    /// [`STALL`](super::pool::STALL) and serves it.
    /// It has `finished` the publishes of its last work.
    pub(crate) fn pauses(&self, finished: usize) {
        let mut state = self.lock();
        state.serving -= 1;
        self.finished(&mut state, finished);
    }

    /// The lane's task could not be started, or will never run again (its
    /// runtime dropped it). With nobody serving, the queued publishes are
    /// handed back for the caller to serve or count as dropped; otherwise
    /// the servers on the lane take them.
    pub(crate) fn task_gone(&self) -> Vec<Arc<Fanout<T>>> {
        let mut state = self.lock();
        state.task = false;
        if state.serving > 0 {
            return Vec::new();
        }
        let jobs = state.queue.drain(..).map(|queued| queued.job).collect();
        if state.waiting > 0 {
            self.room.notify_all();
        }
        jobs
    }
}

/// Takes the head's work: a batch of the publishes that fit together (at
/// most `limit`), or one job.
fn take<T: Send + Sync + 'static>(queue: &mut VecDeque<Queued<T>>, limit: usize) -> Work<T> {
    let first = queue
        .pop_front()
        .expect("taken only from a non-empty queue");
    let batchable = |queued: &Queued<T>| !queued.helped && queued.job.has_one_claiming_runner();
    if !batchable(&first) {
        return Work::Job(first.job);
    }
    let mut jobs = Jobs::new();
    jobs.push(first.job);
    while jobs.len() < limit.min(MAX_BATCH) {
        match queue.front() {
            Some(next) if batchable(next) && jobs[0].same_chunks(&next.job) => {
                jobs.push(queue.pop_front().expect("looked at").job);
            }
            _ => break,
        }
    }
    if jobs.len() == 1 {
        Work::Job(jobs.pop().expect("one"))
    } else {
        Work::Batch(Batch::of(jobs))
    }
}
