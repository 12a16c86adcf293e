//! Ordered handlers: a subscription whose calls never overlap and follow
//! each publisher's publish order.
//!
//! # Contract
//! - An ordered subscription is a bounded mailbox (the publisher pushes into
//!   it, in publish order, as for a stream) drained by one *drain* at a time:
//!   a `scheduled` flag, set by the push that finds it clear, admits a single
//!   drain, which runs the handler on each message in turn. The drain clears
//!   the flag when the mailbox is empty and then looks once more, so a push
//!   that raced the clear is never left without a drain.
//! - Where a drain runs is the mode's: a pool job, a tokio task (within
//!   `max_inflight_tasks`), or the publisher itself in `Inline` mode. When
//!   the pool's queue or the task cap is full, the publisher runs it, under
//!   every `Overflow` policy (a drain cannot be dropped without dropping
//!   what it carries). An async ordered handler's drain is always a task on
//!   the bus's runtime: it awaits each call before the next.
//! - A slow ordered handler holds up only its own drain: other
//!   subscriptions run elsewhere. Its mailbox is bounded (the bus's
//!   `stream_capacity`); a message that does not fit is dropped and counted.
//! - Each queued message is a delivery in flight until the drain has run it
//!   (or skipped it: the subscription was removed first), so `close` waits
//!   for ordered handlers too. A drain the runtime drops before it ran
//!   counts what it would have run as dropped.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock, Weak};

use tokio::runtime::Handle;

use super::permit::TaskPermit;
use super::pool::Ticket;
use super::{report_panic, Env};
use crate::message::Message;
use crate::registry::entry::{BoxFuture, StreamEntry, Subscriber};
use crate::registry::mailbox::{Consumer, Mailbox};
use crate::registry::quiesce;
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
    /// The subscription's entry, set once it exists; weak, since the entry's
    /// mailbox holds this. A drain holds it strongly while it runs.
    entry: OnceLock<Weak<Subscriber<T, Mailbox<T>>>>,
    scheduled: AtomicBool,
    env: Arc<Env>,
    on: DrainOn<T>,
}

impl<T: Send + Sync + 'static> Ordered<T> {
    pub(crate) fn new(handler: OrderedHandler<T>, env: Arc<Env>, on: DrainOn<T>) -> Self {
        Self {
            handler,
            entry: OnceLock::new(),
            scheduled: AtomicBool::new(false),
            env,
            on,
        }
    }

    /// Links the drain to its subscription's entry.
    pub(crate) fn attach(&self, entry: &StreamEntry<T>) {
        let _ = self.entry.set(Arc::downgrade(entry));
    }

    /// Runs the handler on everything queued, in order, until the mailbox
    /// is empty; then gives up the `scheduled` flag (see the module docs).
    fn drain(&self, entry: &StreamEntry<T>, handler: &SyncCall<T>) {
        let _present = self.env.quiescence.enter();
        let mut tally = Tally::default();
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
        quiesce::unhold(tally.finished);
        self.env.counters.add(&tally);
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
                    let call = AssertUnwindSafe(handler(Arc::clone(&message)));
                    let outcome = CatchUnwind(call).await;
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

impl<T: Send + Sync + 'static> Consumer for Ordered<T> {
    fn pushed(self: Arc<Self>) {
        fence(Ordering::SeqCst);
        if self.scheduled.swap(true, Ordering::SeqCst) {
            return; // a drain is on it
        }
        let Some(entry) = self.entry.get().and_then(Weak::upgrade) else {
            self.scheduled.store(false, Ordering::SeqCst);
            return;
        };
        let job = DrainJob {
            ordered: self,
            entry,
            ran: false,
        };
        job.dispatch();
    }
}

/// A scheduled drain: it holds the entry strongly, and if it is dropped
/// without having run (a runtime shutting down), it discards what it would
/// have run, counted.
struct DrainJob<T: Send + Sync + 'static> {
    ordered: Arc<Ordered<T>>,
    entry: StreamEntry<T>,
    ran: bool,
}

impl<T: Send + Sync + 'static> DrainJob<T> {
    fn dispatch(self) {
        let ordered = Arc::clone(&self.ordered);
        match (&ordered.handler, &ordered.on) {
            (OrderedHandler::Async(_), _) => self.spawn_async(),
            (OrderedHandler::Sync(_), DrainOn::Inline) => self.run(),
            (OrderedHandler::Sync(_), DrainOn::Pool(queue)) => {
                let ticket = Ticket::Drain(Box::new(move || self.run()));
                if let Err(refused) = queue.try_send(ticket) {
                    // The queue is full: the publisher drains it itself.
                    if let Ticket::Drain(run) = super::pool::refused_ticket(refused) {
                        run();
                    }
                }
            }
            (OrderedHandler::Sync(_), DrainOn::Tasks(handle)) => {
                match TaskPermit::acquire(&ordered.env) {
                    Some(permit) => {
                        handle.spawn(async move {
                            let _permit = permit;
                            self.run();
                        });
                    }
                    None => self.run(),
                }
            }
        }
    }

    /// Marks the drain as having run to its end.
    fn done(&mut self) {
        self.ran = true;
    }

    fn run(mut self) {
        self.done();
        if let OrderedHandler::Sync(handler) = &self.ordered.handler {
            self.ordered.drain(&self.entry, handler.as_ref());
        }
    }

    fn spawn_async(mut self) {
        let Some(handle) = self.ordered.env.handle.clone() else {
            // Async ordered subscriptions are refused on a bus without a
            // runtime; should one get here, `Drop` counts what it carries.
            return;
        };
        let permit = TaskPermit::acquire(&self.ordered.env);
        handle.spawn(async move {
            let _permit = permit;
            if let OrderedHandler::Async(handler) = &self.ordered.handler {
                self.ordered
                    .drain_async(&self.entry, handler.as_ref())
                    .await;
            }
            self.done();
        });
    }
}

impl<T: Send + Sync + 'static> Drop for DrainJob<T> {
    fn drop(&mut self) {
        if !self.ran {
            self.ordered.discard(&self.entry);
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
