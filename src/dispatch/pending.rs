//! Async deliveries that outlive their first poll.
//!
//! An async handler's future is polled once where its delivery runs (a
//! worker, a task runner, or the publisher). Most handlers finish then and
//! cost nothing more. One that is still pending continues as its own task on
//! the bus's runtime, so an awaiting handler never holds up a runner. Those
//! tasks count against `max_inflight_tasks`. At the cap, a task runner
//! finishes the future itself (it already holds a task slot; its pending
//! deliveries are awaited together), and elsewhere the overflow policy
//! decides:
//! - `Wait` / `CallerRuns`: the delivery's runner finishes the future
//!   itself, blocking its thread, as it would for a slow sync handler: a
//!   worker thread, a publisher outside any runtime, or a publisher on a
//!   multi-thread runtime's thread (through `tokio::task::block_in_place`,
//!   so the runtime's other tasks move to another thread). Nothing waits
//!   for a slot: a delivery that did could wait for the very task that
//!   awaits it (a request's answer, a `close` from a handler). A publisher
//!   on a current-thread runtime cannot block (the future needs that very
//!   thread), nor can one inside an async handler's first poll (which
//!   enters the bus's runtime context, so the thread's own runtime cannot
//!   be told): there the future continues as a task past the cap, up to
//!   the cap again, and beyond that is cancelled and counted as dropped. A
//!   `close` awaited in a future finished in place does not wait for the
//!   rest of the stack that blocks on it (`quiesce::finishing_in_place`);
//! - `Drop` / `Error`: the future is cancelled and counted as dropped (in
//!   `Inline` mode `publish` then returns `Error::Overloaded` under `Error`).
//!   Its `Drop` is user code: a panic there is caught and logged
//!   ([`cancel`]).
//!
//! A future that a runner finishes itself (a pool worker in place, a lane's
//! task awaiting it at the cap) holds that runner up: a publish it makes to
//! the same bus runs its job on this thread instead of queueing it behind
//! the runner, so a request it makes reaches its responder
//! ([`holds_runner_here`]).
//!
//! A continued delivery stays in flight until its future completes, panics
//! (caught and counted) or is cancelled by the runtime shutting down
//! (counted as dropped), so `close` waits for it.

use std::any::Any;
use std::cell::Cell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use tokio::runtime::{Handle, RuntimeFlavor};

use super::permit::TaskPermit;
use super::{report_panic, Env};
use crate::config::Overflow;
use crate::registry::entry::BoxFuture;
use crate::registry::quiesce::{finishing_in_place, finishing_in_place_here};
use crate::stats::Tally;

/// Polls a just-started async delivery once. `Some` if it is not finished.
pub(crate) fn first_poll(mut future: BoxFuture, handle: Option<&Handle>) -> Option<BoxFuture> {
    // Inside the runtime's context, so the handler may use tokio's timers and
    // I/O even when this thread is a pool worker.
    let _context = handle.map(Handle::enter);
    let _entered = EnteredForPoll::mark();
    // The waker is a placeholder: a future that returns Pending here is polled
    // again (with a real waker) by whoever takes it over.
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(()) => None,
        Poll::Pending => Some(future),
    }
}

#[cfg(not(loom))]
std::thread_local!(static ENTERED_FOR_POLL: Cell<u32> = const { Cell::new(0) });
#[cfg(loom)]
loom::thread_local!(static ENTERED_FOR_POLL: Cell<u32> = Cell::new(0));

/// Marks this thread as inside [`first_poll`]'s entered runtime context,
/// which hides what the thread really is: a publish from that handler's
/// first poll may be on a current-thread runtime's thread that only looks
/// like one of the bus's multi-thread runtime, where
/// `tokio::task::block_in_place` would panic.
struct EnteredForPoll;

impl EnteredForPoll {
    fn mark() -> Self {
        ENTERED_FOR_POLL.with(|depth| depth.set(depth.get() + 1));
        Self
    }

    fn here() -> bool {
        ENTERED_FOR_POLL.with(Cell::get) > 0
    }
}

impl Drop for EnteredForPoll {
    fn drop(&mut self) {
        ENTERED_FOR_POLL.with(|depth| depth.set(depth.get() - 1));
    }
}

#[cfg(not(loom))]
std::thread_local!(static HOLDING_RUNNER: Cell<usize> = const { Cell::new(0) });
#[cfg(loom)]
loom::thread_local!(static HOLDING_RUNNER: Cell<usize> = Cell::new(0));

/// While alive, this thread polls async deliveries that a runner of the
/// bus `env` waits for before it can go on (a pool worker finishing one in
/// place, a lane's task awaiting those it took at the task cap). A publish
/// they make to that bus must not queue its job behind that runner, which
/// cannot take it before they finish: a request would wait for its own
/// responder. So [`holds_runner_here`] tells the dispatcher to run the job
/// on this thread (as `CallerRuns` does), with the mark cleared meanwhile
/// ([`run_unmarked`]); a pending delivery of that job, on a thread already
/// blocked in place, continues as a task past the cap (a `block_on` does
/// not nest).
struct HoldingRunner(usize);

impl HoldingRunner {
    fn mark(env: &Env) -> Self {
        let key = std::ptr::from_ref(env) as usize;
        Self(HOLDING_RUNNER.with(|held| held.replace(key)))
    }
}

impl Drop for HoldingRunner {
    fn drop(&mut self) {
        HOLDING_RUNNER.with(|held| held.set(self.0));
    }
}

/// Runs `job` (a publish's job that [`holds_runner_here`] sent to this
/// thread) with the mark cleared: the handlers it runs are not the futures
/// the runner waits for, and their own publishes queue as usual (were they
/// run here too, a relay of handlers would nest on this stack without
/// bound).
pub(crate) fn run_unmarked<R>(job: impl FnOnce() -> R) -> R {
    let _outer = HoldingRunner(HOLDING_RUNNER.with(|held| held.replace(0)));
    job()
}

/// Whether this thread is inside an async delivery's first poll
/// ([`first_poll`]).
pub(crate) fn in_first_poll() -> bool {
    EnteredForPoll::here()
}

/// Runs `publish` with its job run on this thread, as a publish made by a
/// delivery a runner waits for is ([`holds_runner_here`]): for a request
/// made on a pool worker, which then waits for the replies the job's
/// handlers send. Queued, the job could wait behind the very worker that
/// waits for it (in a pool of one, for ever). Only the job `publish` makes
/// runs here: its handlers' own publishes queue as usual.
pub(crate) fn publish_in_place<R>(env: &Env, publish: impl FnOnce() -> R) -> R {
    let _mark = HoldingRunner::mark(env);
    publish()
}

/// Whether this thread is polling async deliveries a runner of `env`'s bus
/// waits for (see [`HoldingRunner`]), or publishing in place
/// ([`publish_in_place`]).
pub(crate) fn holds_runner_here(env: &Env) -> bool {
    HOLDING_RUNNER.with(Cell::get) == std::ptr::from_ref(env) as usize
}

/// Where a pending delivery surfaced, which decides what `CallerRuns` means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// A worker thread: may block.
    Worker,
    /// A task runner: may await the future before it finishes.
    Task,
    /// A publisher's thread, inside or outside a runtime.
    Publisher,
}

/// Where [`settle`] left a pending delivery.
pub(crate) enum Handed {
    /// It continues off this thread's stack (a task of its own)
    /// and will count its own outcome.
    Away,
    /// It was finished or dropped here, and its outcome is in the tally.
    Done,
    /// Back to the task runner, which awaits it itself.
    Back(BoxFuture),
}

/// Takes over a pending delivery. Hands it back only when `place` is
/// [`Place::Task`] and the task runner must await it itself.
pub(crate) fn settle(future: BoxFuture, env: &Arc<Env>, place: Place, tally: &mut Tally) -> Handed {
    let Some(handle) = env.handle.as_ref() else {
        // Async subscriptions are refused on a bus without a runtime.
        tracing::error!("an async delivery has no runtime to continue on; dropped");
        tally.dropped += 1;
        tally.finished += 1;
        return Handed::Done;
    };
    if let Some(permit) = TaskPermit::acquire(env) {
        handle.spawn(finish(future, Arc::clone(env), Some(permit)));
        return Handed::Away;
    }
    if place == Place::Task {
        // A task runner already holds a task slot: finishing the delivery
        // there takes no new one, whatever the policy.
        return Handed::Back(future);
    }
    match env.overflow {
        Overflow::Drop | Overflow::Error => {
            cancel(future);
            tally.dropped += 1;
            tally.finished += 1;
        }
        // Finished where it is, waiting or not: nothing waits for a slot
        // (see the module docs).
        Overflow::Wait | Overflow::CallerRuns => match Handle::try_current() {
            Ok(current) if place == Place::Publisher => {
                if current.runtime_flavor() == RuntimeFlavor::MultiThread
                    && !EnteredForPoll::here()
                    && !finishing_in_place_here()
                {
                    let outcome = tokio::task::block_in_place(|| {
                        finishing_in_place(|| handle.block_on(CatchUnwind(future)))
                    });
                    record(outcome, tally);
                } else {
                    return past_the_cap(future, env, handle, tally);
                }
            }
            // Inside an in-place finishing already (a publish its future
            // made, run here): no second block on this thread.
            _ if finishing_in_place_here() => return past_the_cap(future, env, handle, tally),
            _ => {
                let _holding = (place == Place::Worker).then(|| HoldingRunner::mark(env));
                record(
                    finishing_in_place(|| handle.block_on(CatchUnwind(future))),
                    tally,
                );
            }
        },
    }
    Handed::Done
}

/// A pending delivery whose publisher can neither block for it nor leave
/// it to a runner: a task past the cap while there is room for one (up to
/// the cap again: [`TaskPermit::acquire_past_cap`]), else cancelled and
/// counted as dropped, so a publisher that never blocks (a current-thread
/// runtime's, a pipeline of async handlers publishing from their first
/// poll) cannot pile up tasks without bound.
fn past_the_cap(future: BoxFuture, env: &Arc<Env>, handle: &Handle, tally: &mut Tally) -> Handed {
    match TaskPermit::acquire_past_cap(env) {
        Some(permit) => {
            handle.spawn(finish(future, Arc::clone(env), Some(permit)));
            Handed::Away
        }
        None => {
            cancel(future);
            tally.dropped += 1;
            tally.finished += 1;
            Handed::Done
        }
    }
}

/// Drops an async delivery's future that will not run to its end (the
/// task cap under `Drop`/`Error`, a bus closed before its first poll). Its
/// `Drop` is user code: a panic there is caught and logged, and the
/// delivery is counted as the caller says (dropped), not left uncounted
/// with its runner unwound.
pub(crate) fn cancel(future: BoxFuture) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| drop(future))) {
        tracing::warn!(
            panic = crate::panic_message::panic_message(panic.as_ref()),
            "an async handler's future panicked as it was dropped unfinished; counted as dropped"
        );
    }
}

/// Runs a pending delivery to its end as a task, accounting for it. The
/// accounting guard is built before the task is spawned, so a task the
/// runtime drops unpolled still counts its delivery (as dropped).
fn finish(
    future: BoxFuture,
    env: Arc<Env>,
    permit: Option<TaskPermit>,
) -> impl Future<Output = ()> + Send {
    let mut outcome = Outcome::new(env);
    async move {
        record(CatchUnwind(future).await, &mut outcome.tally);
        outcome.settled = true;
        // The slot first, then the count: a publisher that sees the delivery
        // finished finds the slot free.
        drop(permit);
        drop(outcome);
    }
}

/// Awaits pending deliveries inside a task runner, all at once. Those that
/// finish while others still await are counted at once: one may be
/// waiting for another to be counted (a `close` awaited in a handler waits
/// for everything but its own delivery). Those that finish last are added
/// to `tally`, which the runner reports once its task slot is free. Any
/// still pending if this future is dropped (the runtime shutting down) are
/// counted as dropped at once.
pub(super) async fn finish_here(futures: Vec<BoxFuture>, env: &Arc<Env>, tally: &mut Tally) {
    let mut here = AwaitedHere {
        pending: futures.into_iter().map(CatchUnwind).collect(),
        env: Arc::clone(env),
    };
    std::future::poll_fn(|cx| {
        // The task runner awaiting these serves nothing else meanwhile.
        let _holding = HoldingRunner::mark(env);
        let mut done = Tally::default();
        here.pending
            .retain_mut(|future| match Pin::new(future).poll(cx) {
                Poll::Pending => true,
                Poll::Ready(outcome) => {
                    record(outcome, &mut done);
                    false
                }
            });
        if here.pending.is_empty() {
            tally.finished += done.finished;
            tally.delivered += done.delivered;
            tally.panics += done.panics;
            Poll::Ready(())
        } else {
            if done.finished > 0 {
                here.env.counters.add(&done);
            }
            Poll::Pending
        }
    })
    .await;
}

/// Pending deliveries a task runner awaits; see [`finish_here`].
struct AwaitedHere {
    pending: Vec<CatchUnwind>,
    env: Arc<Env>,
}

impl Drop for AwaitedHere {
    fn drop(&mut self) {
        let left = self.pending.len() as u64;
        if left > 0 {
            self.pending.clear();
            self.env.counters.add(&Tally {
                finished: left,
                dropped: left,
                ..Tally::default()
            });
        }
    }
}

/// Counts one finished async delivery: delivered, or a caught panic.
fn record(outcome: Result<(), Box<dyn Any + Send>>, tally: &mut Tally) {
    match outcome {
        Ok(()) => tally.delivered += 1,
        Err(panic) => {
            tally.panics += 1;
            report_panic("(async handler)", None, panic.as_ref());
        }
    }
    tally.finished += 1;
}

/// Adds a continued delivery's outcome to the counters when its task is
/// done with it, however that ends: a task dropped by a runtime shutting
/// down counts its delivery as dropped.
struct Outcome {
    env: Arc<Env>,
    tally: Tally,
    settled: bool,
}

impl Outcome {
    fn new(env: Arc<Env>) -> Self {
        Self {
            env,
            tally: Tally::default(),
            settled: false,
        }
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.settled {
            self.tally.dropped = 1;
            self.tally.finished = 1;
        }
        self.env.counters.add(&self.tally);
    }
}

/// A future adapter that turns a panic while polling into an `Err`.
struct CatchUnwind(BoxFuture);

impl Future for CatchUnwind {
    type Output = Result<(), Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = &mut self.0;
        match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(poll) => poll.map(Ok),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
