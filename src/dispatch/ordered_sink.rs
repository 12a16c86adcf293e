//! [`OrderedSink`]: a sync ordered handler, delivered by the fan-out like
//! any handler and reading its node's [`OrderedLog`].
//!
//! # Contract
//! - A publish appends its message to the node's log (once for all the
//!   node's ordered subscriptions) and delivers to each of them in its job,
//!   with the message's position. Calls never overlap and follow the log's
//!   order, which keeps each publisher's order.
//! - **One runner at a time.** A delivery first skips a message already run
//!   (`cursor` past it), then counts itself in `pending`; the one that
//!   finds `pending` at zero is the runner, the others return at once (the
//!   runner will run their messages). The runner runs its own message
//!   directly when it is the next one (the common case: a subscription's
//!   deliveries reach it in order, on one worker), else reads the log from
//!   `cursor` to the head; then it tries to bring `pending` back to zero
//!   and, if more deliveries arrived meanwhile, catches up again. The
//!   read-modify-writes on `pending` order each arrival's append before the
//!   runner's next look at the head.
//! - **Counted by the sink.** Each call the runner makes is counted
//!   delivered (or a caught panic); a message pushed out of the log before
//!   the runner reached it is counted dropped (the handler fell more than
//!   `stream_capacity` behind); a message reached after the subscription
//!   was removed is skipped. The job counts each delivery finished when it
//!   returns: a delivery that returned early has a runner still in flight,
//!   which runs its message before returning, so `close` and
//!   `unsubscribe_and_wait` wait for it.
//! - **A delivery that will not run** (its job dropped it: a full queue
//!   under `Overflow::Drop`, a runtime shutting down) is settled the same
//!   way, except that the runner counts what it finds as dropped instead of
//!   running it.
//! - A handler that publishes to itself (any mode) finds `pending` held by
//!   its own runner and leaves the message to it: no recursion.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use super::report_panic;
use crate::message::Message;
use crate::registry::entry::{BoxFuture, Delivery, Outcome, Sink, Tracked, NO_POSITION};
use crate::registry::ordered_log::OrderedLog;
use crate::registry::quiesce::Running;
use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// A sync ordered handler.
type Handler<T> = dyn Fn(&Message<T>) + Send + Sync;

/// A sync ordered subscription's sink.
pub(crate) struct OrderedSink<T> {
    handler: Box<Handler<T>>,
    /// Set once the subscription is in the trie (the node's log exists
    /// then); a delivery before that has nothing to run.
    log: OnceLock<Arc<OrderedLog<T>>>,
    /// The next position to run.
    cursor: AtomicU64,
    /// Deliveries counted in since the runner started; see the module docs.
    pending: AtomicUsize,
    /// Cleared when the subscription is removed: the runner skips the rest.
    active: AtomicBool,
    id: u64,
}

impl<T: Send + Sync + 'static> OrderedSink<T> {
    pub(crate) fn new(handler: Box<Handler<T>>, id: u64) -> Self {
        Self {
            handler,
            log: OnceLock::new(),
            cursor: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            active: AtomicBool::new(true),
            id,
        }
    }

    /// Starts reading `log` (the subscription is in the trie): messages
    /// appended from now on reach it. Called once, before `subscribe`
    /// returns the handle, so no removal can race it.
    pub(crate) fn attach(&self, log: Arc<OrderedLog<T>>) {
        self.cursor.store(log.join(), Ordering::SeqCst);
        let _ = self.log.set(log);
    }

    /// Counts in a delivery of `position`; true if the caller is now the
    /// runner.
    fn arrive(&self, position: u64) -> bool {
        position != NO_POSITION
            && self.cursor.load(Ordering::Acquire) <= position
            && self.pending.fetch_add(1, Ordering::AcqRel) == 0
    }

    /// The runner's loop (see the module docs): runs (or, if `discarding`,
    /// counts dropped) everything up to the head, starting with `first` if
    /// it is the next message, until no delivery is left counted in.
    fn run(
        &self,
        log: &OrderedLog<T>,
        mut first: Option<(&Message<T>, u64)>,
        discarding: bool,
    ) -> Outcome {
        let mut tally = Outcome::default();
        let mut batch = Vec::new();
        let mut seen = 1;
        loop {
            let cursor = self.cursor.load(Ordering::Relaxed);
            match first.take() {
                Some((message, position)) if position == cursor => {
                    self.call(message, discarding, &mut tally);
                    self.cursor.store(position + 1, Ordering::Release);
                }
                _ => {
                    if cursor < log.head() {
                        let start = log.read(cursor, &mut batch);
                        // Pushed out of the ring before this runner got to them.
                        tally.dropped += u32::try_from(start - cursor).unwrap_or(u32::MAX);
                        let mut next = start;
                        for message in batch.drain(..) {
                            self.call(&message, discarding, &mut tally);
                            next += 1;
                            self.cursor.store(next, Ordering::Release);
                        }
                    }
                }
            }
            match self
                .pending
                .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                // More arrived: their messages are appended; catch up.
                Err(now) => seen = now,
            }
        }
        tally
    }

    /// One message: the handler's call, counted; skipped once removed;
    /// counted dropped if discarding.
    fn call(&self, message: &Message<T>, discarding: bool, tally: &mut Outcome) {
        if !self.active.load(Ordering::Acquire) {
            return;
        }
        if discarding {
            tally.dropped += 1;
            return;
        }
        match catch_unwind(AssertUnwindSafe(|| (self.handler)(message))) {
            Ok(()) => tally.delivered += 1,
            Err(panic) => {
                tally.panics += 1;
                report_panic(message.topic(), Some(self.id), panic.as_ref());
            }
        }
    }
}

impl<T: Send + Sync + 'static> Sink<T> for OrderedSink<T> {
    /// Not reached: ordered subscriptions are neither shared nor primed, so
    /// only a publish's job delivers to them, through [`Sink::deliver_at`].
    /// A message without a position in the log has nothing to run.
    fn deliver(&self, _message: &Arc<Message<T>>) -> Option<BoxFuture> {
        None
    }

    fn deliver_at(&self, message: &Arc<Message<T>>, position: u64) -> Delivery {
        match self.log.get() {
            Some(log) if self.arrive(position) => {
                Delivery::Ran(self.run(log, Some((message, position)), false))
            }
            _ => Delivery::Ran(Outcome::default()),
        }
    }

    fn discard_at(&self, position: u64) -> Option<Outcome> {
        Some(match self.log.get() {
            Some(log) if self.arrive(position) => self.run(log, None, true),
            _ => Outcome::default(),
        })
    }
}

impl<T> Tracked for OrderedSink<T> {
    fn running(&self) -> Option<Arc<Running>> {
        None
    }

    fn deactivated(&self) {
        if self.active.swap(false, Ordering::SeqCst) {
            if let Some(log) = self.log.get() {
                log.leave();
            }
        }
    }
}
