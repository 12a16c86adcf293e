//! Async ordered handlers: a subscription whose calls never overlap and
//! follow each publisher's publish order, each call awaited before the next.
//! (Sync ordered handlers read their node's log instead: `ordered_sink.rs`.)
//!
//! # Contract
//! - An async ordered subscription is a bounded mailbox (the publisher
//!   pushes into it, in publish order, as for a stream) drained by one
//!   *drain* at a time: a `scheduled` flag, claimed by the publisher whose
//!   push finds it clear, admits a single drain, which awaits the handler on
//!   each message in turn. The drain clears the flag when the mailbox is
//!   empty and then looks once more, so a push that raced the clear is never
//!   left without a drain.
//! - A drain is a task on the bus's runtime (within `max_inflight_tasks`
//!   where there is room; a drain is never dropped for want of it). It
//!   checks the subscription's flag and calls the handler as a runner
//!   (inside `Quiescence::enter`), and tracks the returned future before it
//!   leaves, so `unsubscribe_and_wait` waits for the whole call (the `Fn`
//!   body, then the future) as for any async handler (its mailbox reports
//!   the tracker), and no call starts after `unsubscribe` returned.
//! - A slow ordered handler holds up only its own drain. Its mailbox is
//!   bounded (the bus's `stream_capacity`); a message that does not fit is
//!   dropped and counted.
//! - Each queued message is a delivery in flight until the drain has run it
//!   (or skipped it: the subscription was removed first), so `close` waits
//!   for ordered handlers too. A drain the runtime drops before it finished
//!   counts what it would have run as dropped.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::permit::TaskPermit;
use super::{report_panic, Env};
use crate::message::Message;
use crate::registry::entry::{BoxFuture, StreamEntry};
use crate::registry::quiesce::Running;
use crate::stats::Tally;
use crate::sync::{fence, AtomicBool, Ordering};

/// An async ordered handler: a call starts a future.
pub(crate) type AsyncCall<T> = dyn Fn(Arc<Message<T>>) -> BoxFuture + Send + Sync;

/// One async ordered subscription's drain.
pub(crate) struct Ordered<T> {
    /// Taken out (and dropped) by `unsubscribe_and_wait` once no call of it
    /// runs (see [`Self::release_when_removed`]): the drain may hold the
    /// subscription a while longer, skipping what is still queued. A call
    /// clones it out of the lock, so no user code runs under it.
    handler: Mutex<Option<Arc<AsyncCall<T>>>>,
    /// The calls in progress, as `unsubscribe_and_wait` sees them (the
    /// mailbox reports the same tracker).
    running: Arc<Running>,
    scheduled: AtomicBool,
    env: Arc<Env>,
}

impl<T: Send + Sync + 'static> Ordered<T> {
    pub(crate) fn new(handler: Box<AsyncCall<T>>, env: Arc<Env>) -> Self {
        Self {
            handler: Mutex::new(Some(Arc::from(handler))),
            running: Arc::new(Running::new(env.quiescence.id())),
            scheduled: AtomicBool::new(false),
            env,
        }
    }

    /// The handler's calls in progress.
    pub(crate) fn running(&self) -> Arc<Running> {
        Arc::clone(&self.running)
    }

    /// Lets `unsubscribe_and_wait`, once no call runs, drop the handler
    /// (and what it captured) rather than leave it to the drain's end.
    pub(crate) fn release_when_removed(self: &Arc<Self>) {
        let ordered = Arc::downgrade(self);
        self.running.on_removed(Box::new(move || {
            if let Some(ordered) = ordered.upgrade() {
                let handler = lock(&ordered.handler).take();
                // The user's closure goes after the lock.
                drop(handler);
            }
        }));
    }

    /// The handler, unless it was released.
    fn handler(&self) -> Option<Arc<AsyncCall<T>>> {
        lock(&self.handler).clone()
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
    /// as dropped: a drain the runtime dropped before it ran. Lets go of the
    /// subscription as a drain does, looking again after: a message pushed
    /// meanwhile (its publisher saw the drain still scheduled) is not left
    /// without one.
    fn discard(&self, entry: &StreamEntry<T>) {
        loop {
            let mut tally = Tally::default();
            while entry.sink.try_pop().is_ok() {
                tally.finished += 1;
                tally.dropped += 1;
            }
            self.env.counters.add(&tally);
            if !self.release_or_continue(entry) {
                break;
            }
        }
    }

    /// The drain: awaits each call before the next.
    async fn drain(&self, entry: &StreamEntry<T>) {
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
                // The flag check and the handler's `Fn` body run as a runner
                // (inside a presence), and the future is tracked before it
                // leaves: a grace period either sees this call, or it
                // started after the flag was cleared and this sees that.
                // A panic in the `Fn` body is caught as one in the future:
                // that call counts as a panic and the drain goes on.
                let tracked = {
                    let _presence = self.env.quiescence.enter();
                    let handler = entry.is_active().then(|| self.handler()).flatten();
                    handler.map(|handler| {
                        catch_unwind(AssertUnwindSafe(|| {
                            self.running.track(handler(Arc::clone(&message)))
                        }))
                    })
                };
                let outcome = match tracked {
                    Some(Ok(tracked)) => {
                        // Counted as dropped until it completes.
                        let tracked = std::pin::pin!(tracked);
                        Some(CatchUnwind(AssertUnwindSafe(tracked)).await)
                    }
                    Some(Err(panic)) => Some(Err(panic)),
                    None => None,
                };
                settle.tally.dropped = 0;
                match outcome {
                    Some(Ok(())) => settle.tally.delivered = 1,
                    Some(Err(panic)) => {
                        settle.tally.panics = 1;
                        report_panic(message.topic(), Some(entry.id()), panic.as_ref());
                    }
                    None => {}
                }
            }
            if !self.release_or_continue(entry) {
                break;
            }
        }
    }

    /// A message was queued: claims the subscription for a drain the caller
    /// must start, unless a drain already holds it (that one will see the
    /// message: it looks again after letting go).
    pub(crate) fn claim(&self) -> bool {
        // Pairs with the fence in `release_or_continue`.
        fence(Ordering::SeqCst);
        !self.scheduled.swap(true, Ordering::SeqCst)
    }
}

fn lock<V>(mutex: &Mutex<V>) -> std::sync::MutexGuard<'_, V> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The drain behind an ordered subscription's entry.
fn ordered_of<T: Send + Sync + 'static>(entry: &StreamEntry<T>) -> Option<&Ordered<T>> {
    entry.sink.consumer()?.downcast_ref::<Ordered<T>>()
}

/// Starts the drains a publish claimed (see [`Ordered::claim`]), after it
/// has pushed everything: a task each.
pub(crate) fn start_drains<T: Send + Sync + 'static>(claimed: SmallVec<[StreamEntry<T>; 4]>) {
    for entry in claimed {
        DrainJob { entry, ran: false }.spawn();
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

    fn spawn(mut self) {
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
                ordered.drain(&entry).await;
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
