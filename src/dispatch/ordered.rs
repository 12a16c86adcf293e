//! Ordered handlers: a subscription whose calls never overlap and follow
//! each publisher's publish order.
//!
//! # Contract
//! - An ordered subscription is a bounded mailbox (the publisher pushes into
//!   it, in publish order, as for a stream) drained by one *drain* at a time:
//!   a `scheduled` flag, claimed by the publisher whose push finds it clear,
//!   admits a single drain, which runs the handler on each message in turn.
//!   The drain clears the flag when the mailbox is empty and then looks once
//!   more, so a push that raced the clear is never left without a drain.
//! - A publish starts the drains it claimed after it has pushed everything,
//!   together: a few jobs of many drains each, not one per subscription.
//!   Where they run is the mode's: a pool job, a tokio task (within
//!   `max_inflight_tasks`), or the publisher itself in `Inline` mode. When
//!   the pool's queue or the task cap is full, the publisher runs it, under
//!   every `Overflow` policy (a drain cannot be dropped without dropping
//!   what it carries). An async ordered handler's drain is always a task on
//!   the bus's runtime: it awaits each call before the next, and tracks the
//!   call in progress, so `unsubscribe_and_wait` waits for it as for any
//!   async handler (its mailbox reports the tracker).
//! - A slow ordered handler holds up only its own drain: other
//!   subscriptions run elsewhere. Its mailbox is bounded (the bus's
//!   `stream_capacity`); a message that does not fit is dropped and counted.
//! - Each queued message is a delivery in flight until the drain has run it
//!   (or skipped it: the subscription was removed first), so `close` waits
//!   for ordered handlers too. A drain the runtime drops before it ran
//!   counts what it would have run as dropped.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use smallvec::SmallVec;

use tokio::runtime::Handle;

use super::permit::TaskPermit;
use super::pool::Ticket;
use super::{report_panic, Env};
use crate::message::Message;
use crate::registry::entry::{BoxFuture, StreamEntry};
use crate::registry::quiesce::{self, Running};
use crate::stats::Tally;
use crate::sync::channel::Sender;
use crate::sync::{fence, AtomicBool, Ordering};

/// A sync ordered handler.
type SyncCall<T> = dyn Fn(&Message<T>) + Send + Sync;
/// An async ordered handler: a call starts a future.
type AsyncCall<T> = dyn Fn(Arc<Message<T>>) -> BoxFuture + Send + Sync;

/// What an ordered subscription calls.
pub(crate) enum OrderedHandler<T> {
    Sync(Box<SyncCall<T>>),
    Async(Box<AsyncCall<T>>),
}

/// Where this bus runs drains of sync ordered handlers.
pub(crate) enum DrainOn<T> {
    Pool(Sender<Ticket<T>>),
    Tasks(Handle),
    Inline,
}

/// One ordered subscription's drain.
pub(crate) struct Ordered<T> {
    handler: OrderedHandler<T>,
    /// Async only: the calls in progress, as `unsubscribe_and_wait` sees
    /// them (the mailbox reports the same tracker).
    running: Option<Arc<Running>>,
    scheduled: AtomicBool,
    env: Arc<Env>,
    on: DrainOn<T>,
}

impl<T: Send + Sync + 'static> Ordered<T> {
    pub(crate) fn new(handler: OrderedHandler<T>, env: Arc<Env>, on: DrainOn<T>) -> Self {
        let running = matches!(handler, OrderedHandler::Async(_)).then(|| Arc::new(Running::new()));
        Self {
            handler,
            running,
            scheduled: AtomicBool::new(false),
            env,
            on,
        }
    }

    /// The async handler's calls in progress (`None` for a sync handler).
    pub(crate) fn running(&self) -> Option<Arc<Running>> {
        self.running.clone()
    }

    /// Runs the handler on everything queued, in order, until the mailbox
    /// is empty; then gives up the `scheduled` flag (see the module docs).
    /// The caller is present (see `quiesce.rs`) throughout, and adds `tally`
    /// to the counters and unholds its `finished` afterwards: once per
    /// chunk of drains, not per subscription.
    fn drain(&self, entry: &StreamEntry<T>, handler: &SyncCall<T>, tally: &mut Tally) {
        loop {
            while let Ok(message) = entry.sink.try_pop() {
                tally.finished += 1;
                quiesce::hold(1);
                if !entry.is_active() {
                    continue;
                }
                match catch_unwind(AssertUnwindSafe(|| handler(&message))) {
                    Ok(()) => tally.delivered += 1,
                    Err(panic) => {
                        tally.panics += 1;
                        report_panic(message.topic(), Some(entry.id()), panic.as_ref());
                    }
                }
            }
            if !self.release_or_continue(entry) {
                break;
            }
        }
    }

    /// Clears `scheduled`; true if a message arrived meanwhile and this
    /// drain took the flag back to run it.
    fn release_or_continue(&self, entry: &StreamEntry<T>) -> bool {
        self.scheduled.store(false, Ordering::SeqCst);
        // Pairs with the push's fence: either the pusher sees the flag clear
        // (and schedules a drain), or this sees its message.
        fence(Ordering::SeqCst);
        !entry.sink.is_empty() && !self.scheduled.swap(true, Ordering::SeqCst)
    }

    /// Empties the mailbox without running anything, counting what it held
    /// as dropped: a drain the runtime dropped before it ran.
    fn discard(&self, entry: &StreamEntry<T>) {
        let mut tally = Tally::default();
        while entry.sink.try_pop().is_ok() {
            tally.finished += 1;
            tally.dropped += 1;
        }
        self.scheduled.store(false, Ordering::SeqCst);
        self.env.counters.add(&tally);
    }

    /// The async variant's drain: awaits each call before the next.
    async fn drain_async(
        &self,
        entry: &StreamEntry<T>,
        handler: &(dyn Fn(Arc<Message<T>>) -> BoxFuture + Send + Sync),
    ) {
        loop {
            while let Ok(message) = entry.sink.try_pop() {
                // Counted as dropped unless the call completes: the task may
                // be dropped mid-call by a runtime shutting down.
                let mut settle = Settle {
                    env: &self.env,
                    tally: Tally {
                        finished: 1,
                        dropped: 1,
                        ..Tally::default()
                    },
                };
                if entry.is_active() {
                    let call = handler(Arc::clone(&message));
                    let outcome = match &self.running {
                        // Counted until it completes or is dropped.
                        Some(running) => {
                            let tracked = std::pin::pin!(running.track(call));
                            CatchUnwind(AssertUnwindSafe(tracked)).await
                        }
                        None => CatchUnwind(AssertUnwindSafe(call)).await,
                    };
                    settle.tally.dropped = 0;
                    match outcome {
                        Ok(()) => settle.tally.delivered = 1,
                        Err(panic) => {
                            settle.tally.panics = 1;
                            report_panic(message.topic(), Some(entry.id()), panic.as_ref());
                        }
                    }
                } else {
                    settle.tally.dropped = 0;
                }
            }
            if !self.release_or_continue(entry) {
                break;
            }
        }
    }
}

/// The drain behind an ordered subscription's entry.
fn ordered_of<T: Send + Sync + 'static>(entry: &StreamEntry<T>) -> Option<&Ordered<T>> {
    entry.sink.consumer()?.downcast_ref::<Ordered<T>>()
}

/// Starts the drains a publish claimed (see [`Ordered::claim`]), after it
/// has pushed everything: sync drains in a few chunks, one pool job or task
/// each (about one per worker), so a publish to many ordered subscriptions
/// costs a few jobs, not one per subscription; async drains as a task each.
pub(crate) fn start_drains<T: Send + Sync + 'static>(
    claimed: SmallVec<[StreamEntry<T>; 4]>,
    workers: usize,
) {
    let mut sync_drains = Vec::new();
    for entry in claimed {
        let Some(ordered) = ordered_of(&entry) else {
            continue;
        };
        match ordered.handler {
            OrderedHandler::Async(_) => DrainJob { entry, ran: false }.spawn_async(),
            OrderedHandler::Sync(_) => sync_drains.push(entry),
        }
    }
    if sync_drains.is_empty() {
        return;
    }
    let chunk = sync_drains
        .len()
        .div_ceil(workers.max(1))
        .max(MIN_DRAINS_PER_JOB);
    while !sync_drains.is_empty() {
        let rest = sync_drains.split_off(chunk.min(sync_drains.len()));
        DrainChunk {
            entries: std::mem::replace(&mut sync_drains, rest),
        }
        .dispatch();
    }
}

/// Drains fewer than this share a job: starting one costs more than a few
/// drains.
const MIN_DRAINS_PER_JOB: usize = 16;

impl<T: Send + Sync + 'static> Ordered<T> {
    /// A message was queued: claims the subscription for a drain the caller
    /// must start, unless a drain already holds it (that one will see the
    /// message: it looks again after letting go).
    pub(crate) fn claim(&self) -> bool {
        // Pairs with the fence in `release_or_continue`.
        fence(Ordering::SeqCst);
        !self.scheduled.swap(true, Ordering::SeqCst)
    }
}

/// Sync drains started together: they hold their entries, and if the job is
/// dropped without having run them (a runtime shutting down), what they
/// would have run is discarded and counted.
struct DrainChunk<T: Send + Sync + 'static> {
    entries: Vec<StreamEntry<T>>,
}

impl<T: Send + Sync + 'static> DrainChunk<T> {
    fn dispatch(self) {
        let Some(ordered) = self.entries.first().and_then(ordered_of) else {
            return;
        };
        // Taken out before `self` moves into a job.
        let on = match &ordered.on {
            DrainOn::Inline => DrainOn::Inline,
            DrainOn::Pool(queue) => DrainOn::Pool(queue.clone()),
            DrainOn::Tasks(handle) => DrainOn::Tasks(handle.clone()),
        };
        let env = Arc::clone(&ordered.env);
        match on {
            DrainOn::Inline => self.run(),
            DrainOn::Pool(queue) => {
                let ticket = Ticket::Drain(Box::new(move || self.run()));
                if let Err(refused) = queue.try_send(ticket) {
                    // The queue is full: the publisher drains it itself.
                    if let Ticket::Drain(run) = super::pool::refused_ticket(refused) {
                        run();
                    }
                }
            }
            DrainOn::Tasks(handle) => match TaskPermit::acquire(&env) {
                Some(permit) => {
                    handle.spawn(async move {
                        let _permit = permit;
                        self.run();
                    });
                }
                None => self.run(),
            },
        }
    }

    fn run(mut self) {
        // Every entry of a chunk is of the same bus (one publish claimed
        // them): one presence and one tally for all.
        let Some(env) = self
            .entries
            .first()
            .and_then(ordered_of)
            .map(|ordered| Arc::clone(&ordered.env))
        else {
            return;
        };
        let _present = env.quiescence.enter();
        let mut tally = Tally::default();
        while let Some(entry) = self.entries.pop() {
            if let Some(ordered) = ordered_of(&entry) {
                if let OrderedHandler::Sync(handler) = &ordered.handler {
                    ordered.drain(&entry, handler.as_ref(), &mut tally);
                }
            }
        }
        quiesce::unhold(tally.finished);
        env.counters.add(&tally);
    }
}

impl<T: Send + Sync + 'static> Drop for DrainChunk<T> {
    fn drop(&mut self) {
        for entry in self.entries.drain(..) {
            if let Some(ordered) = ordered_of(&entry) {
                ordered.discard(&entry);
            }
        }
    }
}

/// An async ordered subscription's drain, a task of its own; dropped before
/// it finished (a runtime shutting down), it discards what is left, counted.
struct DrainJob<T: Send + Sync + 'static> {
    entry: StreamEntry<T>,
    ran: bool,
}

impl<T: Send + Sync + 'static> DrainJob<T> {
    /// Marks the drain as having run to its end.
    fn done(&mut self) {
        self.ran = true;
    }

    fn spawn_async(mut self) {
        let Some(handle) = ordered_of(&self.entry).and_then(|o| o.env.handle.clone()) else {
            // Async ordered subscriptions are refused on a bus without a
            // runtime; should one get here, `Drop` counts what it carries.
            return;
        };
        let permit = ordered_of(&self.entry).and_then(|o| TaskPermit::acquire(&o.env));
        handle.spawn(async move {
            let _permit = permit;
            let entry = Arc::clone(&self.entry);
            if let Some(ordered) = ordered_of(&entry) {
                if let OrderedHandler::Async(handler) = &ordered.handler {
                    ordered.drain_async(&entry, handler.as_ref()).await;
                }
            }
            self.done();
        });
    }
}

impl<T: Send + Sync + 'static> Drop for DrainJob<T> {
    fn drop(&mut self) {
        if !self.ran {
            if let Some(ordered) = ordered_of(&self.entry) {
                ordered.discard(&self.entry);
            }
        }
    }
}

/// Adds one async ordered delivery's outcome to the counters however its
/// task ends.
struct Settle<'a> {
    env: &'a Env,
    tally: Tally,
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        self.env.counters.add(&self.tally);
    }
}

/// Turns a panic while polling into an `Err`.
struct CatchUnwind<F>(F);

impl<F: Future<Output = ()> + Unpin> Future for CatchUnwind<AssertUnwindSafe<F>> {
    type Output = Result<(), Box<dyn std::any::Any + Send>>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let future = &mut (self.0).0;
        match catch_unwind(AssertUnwindSafe(|| {
            std::pin::Pin::new(&mut *future).poll(cx)
        })) {
            Ok(poll) => poll.map(Ok),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}
