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
//! - **Counted by the sink.** The common case (a delivery that runs its own
//!   message and nothing else, and it returns) is a plain delivery for the
//!   job to count, as for an unordered handler. Otherwise each call the
//!   runner makes is counted delivered (or a caught panic); a message pushed out of the log before
//!   the runner reached it is counted dropped (the handler fell more than
//!   `stream_capacity` behind), even if the runner had already copied it
//!   (the bound is the log's; a batch of a worker's jobs reads the bound
//!   once, as it starts, so one of its messages pushed out while it runs
//!   still runs); a message reached after the subscription
//!   was removed is skipped. The job counts each delivery finished when it
//!   returns: a delivery that returned early has a runner still in flight,
//!   which runs its message before returning, so `close` and
//!   `unsubscribe_and_wait` wait for it.
//! - **A delivery that will not run** (its job refused it: a full queue
//!   under `Overflow::Drop` or `Overflow::Error`, a runtime shutting down)
//!   drops its own message only; it never calls the handler, never counts
//!   in and never waits. With the log's appends held, it looks whether a
//!   runner has read its message from the log already (`read_to`, stored
//!   by each read under the same lock): then that runner runs it, as it
//!   runs everything it read. Else it counts its message dropped and notes
//!   its position ([`Refused`]); every later read sees the note, and the
//!   runner passes the position without a call. So a refusal adds no work
//!   to a runner, and a flood of refusals cannot keep one running. Earlier
//!   messages whose jobs are still queued run when those jobs come, in
//!   order.
//! - A handler that publishes to itself (any mode) finds `pending` held by
//!   its own runner and leaves the message to it: no recursion. In
//!   `Inline` mode the runner runs such a message as deep as its publish
//!   would have run it (`Message::inline_depth`), so the depth limit stops
//!   a handler that always publishes to itself, as it stops a plain one.
//! - **A retained snapshot** (see `retained.rs`): the sink starts with
//!   `pending` held by its subscriber, who runs the snapshot's messages and
//!   then hands back like any runner, catching up on what arrived meanwhile.
//!   A live copy of a retained message the snapshot held (numbered at or
//!   below its `after`) is not run again, and not counted again (the
//!   snapshot's call was). One the log pushed out before a runner read it
//!   is counted as dropped: its number went with it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use super::refused::Refused;
use super::{report_panic, InlineAtLeast};
use crate::message::Message;
use crate::registry::entry::{BoxFuture, Outcome, Settled, Sink, Tracked, NO_POSITION};
use crate::registry::ordered_log::{OrderedLog, Read};
use crate::registry::quiesce::{Quiescence, Running};
use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// A sync ordered subscription's sink. The handler is kept inline (not
/// boxed): a delivery is then one pointer chase from the entry to the
/// handler's captures, as for an unordered handler.
pub(crate) struct OrderedSink<T, H> {
    /// Set once the subscription is in the trie (the node's log exists
    /// then); a delivery before that has nothing to run.
    log: OnceLock<Arc<OrderedLog<T>>>,
    /// The bus's runners' record, set with `log`: a runner catching up
    /// renews its presence between rounds (see [`Self::run`]).
    quiescence: OnceLock<Arc<Quiescence>>,
    /// The next position to run.
    cursor: AtomicU64,
    /// The end of the last read of the log by a runner: positions below it
    /// are the runners' to run. Written and read with the log's appends
    /// held.
    read_to: AtomicU64,
    /// Deliveries counted in since the runner started; see the module docs.
    pending: AtomicUsize,
    /// Cleared when the subscription is removed: the runner skips the rest.
    active: AtomicBool,
    /// Positions ahead of the cursor whose deliveries were refused.
    refused: Refused,
    /// Retained publishes numbered this or lower were in the snapshot the
    /// subscription started with (or older than it): a live copy of one
    /// is not run again. 0 for a subscription without a snapshot.
    after: u64,
    id: u64,
    handler: H,
}

/// What one call did.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Delivered,
    Panicked,
    /// Not made: the subscription left, or the message was in its
    /// snapshot (whose call was counted).
    Skipped,
    Dropped,
}

impl Outcome {
    fn add(&mut self, call: Call) {
        match call {
            Call::Delivered => self.delivered += 1,
            Call::Panicked => self.panics += 1,
            Call::Dropped => self.dropped += 1,
            Call::Skipped => {}
        }
    }

    fn merge(&mut self, other: Outcome) {
        self.delivered += other.delivered;
        self.panics += other.panics;
        self.dropped += other.dropped;
    }
}

impl<T, H> OrderedSink<T, H>
where
    T: Send + Sync + 'static,
    H: Fn(&Message<T>) + Send + Sync + 'static,
{
    pub(crate) fn new(handler: H, id: u64) -> Self {
        Self::starting(handler, id, 0, 0)
    }

    fn starting(handler: H, id: u64, pending: usize, after: u64) -> Self {
        Self {
            log: OnceLock::new(),
            quiescence: OnceLock::new(),
            cursor: AtomicU64::new(0),
            read_to: AtomicU64::new(0),
            pending: AtomicUsize::new(pending),
            active: AtomicBool::new(true),
            refused: Refused::new(),
            after,
            id,
            handler,
        }
    }

    /// A subscription that starts with a retained snapshot taken at
    /// retained number `after`: its subscriber is the runner from the start
    /// (deliveries that arrive meanwhile leave their messages to it), and
    /// runs the snapshot with [`Self::run_snapshot`] before any of them.
    pub(crate) fn primed(handler: H, id: u64, after: u64) -> Self {
        Self::starting(handler, id, 1, after)
    }

    /// The subscriber of a [`Self::primed`] sink, attached: runs the
    /// snapshot's messages, then stops being the runner, first running
    /// what live deliveries left to it meanwhile (the log from where it
    /// attached). Returns what it ran, for the caller to count.
    pub(crate) fn run_snapshot(&self, snapshot: &[Arc<Message<T>>]) -> Outcome {
        // A runner of its own, as any call needs; and so the catch-up that
        // follows renews only this presence, never one of the caller's (a
        // handler subscribing: a wait for it must outlast its call).
        let _presence = self.quiescence.get().map(|quiescence| quiescence.enter());
        let mut tally = Outcome::default();
        for message in snapshot {
            tally.add(self.call(message));
        }
        match self.log.get() {
            Some(log) => tally.merge(self.hand_back(log).unwrap_or_default()),
            // Never attached: no delivery could have run, nor left anything.
            None => self.pending.store(0, Ordering::Release),
        }
        tally
    }

    /// Starts reading `log` (the subscription is in the trie): messages
    /// appended from now on reach it. Called once, before `subscribe`
    /// returns the handle, so no removal can race it.
    pub(crate) fn attach(&self, log: Arc<OrderedLog<T>>, quiescence: Arc<Quiescence>) {
        self.cursor.store(log.join(), Ordering::SeqCst);
        let _ = self.quiescence.set(quiescence);
        let _ = self.log.set(log);
    }

    /// Counts in a delivery of `position`; true if the caller is now the
    /// runner.
    #[inline]
    fn arrive(&self, position: u64) -> bool {
        position != NO_POSITION
            && self.cursor.load(Ordering::Acquire) <= position
            && self.pending.fetch_add(1, Ordering::AcqRel) == 0
    }

    /// The delivery of `position` became the runner: the common case first
    /// (it is the next message and no other delivery arrives while it runs:
    /// one call, counted by the job like any delivery), else the runner's
    /// loop.
    #[inline]
    fn deliver_as_runner(
        &self,
        log: &OrderedLog<T>,
        message: &Message<T>,
        position: u64,
        settled: &mut Settled,
    ) {
        if self.cursor.load(Ordering::Relaxed) != position {
            settled.settle(self.run(log, Some((message, position)), 1));
            return;
        }
        let call = self.call_unless_pushed_out(log, position, message);
        self.cursor.store(position + 1, Ordering::Release);
        let rest = self.hand_back(log);
        if rest.is_none() && call == Call::Delivered {
            return;
        }
        let mut tally = Outcome::default();
        tally.add(call);
        tally.merge(rest.unwrap_or_default());
        settled.settle(tally);
    }

    /// The runner, having run its own deliveries' messages, stops being the
    /// runner: `None` if no delivery counted in meanwhile, else it catches
    /// up on theirs first (what it ran).
    #[inline]
    fn hand_back(&self, log: &OrderedLog<T>) -> Option<Outcome> {
        match self
            .pending
            .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => None,
            Err(now) => Some(self.run(log, None, now)),
        }
    }

    /// A batch's deliveries (see [`Sink::deliver_batch`]) as the runner:
    /// runs each message of `batch` that is the next one, in order, then
    /// hands back as [`Self::deliver_as_runner`] does. One count in and one
    /// out for the whole batch instead of one each per message. A gap (a
    /// message between two of the batch's, from a publish not in it) or a
    /// delivery counted in meanwhile is caught up from the log.
    fn run_batch(&self, log: &OrderedLog<T>, batch: &[(&Arc<Message<T>>, u64)]) -> Outcome {
        let mut tally = Outcome::default();
        let mut gap = false;
        // Only the runner moves the cursor: kept in a register meanwhile.
        let mut cursor = self.cursor.load(Ordering::Relaxed);
        // Read once for the batch: the log's line is the publisher's, which
        // appends to it meanwhile, and a check per message costs as much as
        // a third of the call. A message pushed out while the batch runs
        // (at most the batch's length, held by its jobs) still runs.
        let kept = log.oldest_kept();
        for &(message, position) in batch {
            if position != cursor {
                if position == NO_POSITION || position < cursor {
                    continue;
                }
                gap = true;
                break;
            }
            let call = if position < kept {
                self.dropped_or_skipped()
            } else {
                self.call(message)
            };
            // The common outcome counted without a branch through `add`.
            match call {
                Call::Delivered => tally.delivered += 1,
                other => tally.add(other),
            }
            cursor = position + 1;
            self.cursor.store(cursor, Ordering::Release);
        }
        let rest = if gap {
            Some(self.run(log, None, 1))
        } else {
            self.hand_back(log)
        };
        tally.merge(rest.unwrap_or_default());
        tally
    }

    /// The runner's loop (see the module docs): runs everything up to the
    /// head, starting with `first` if it is the next message and passing
    /// refused positions, until no delivery is left counted in (`seen`: the
    /// count in `pending` it last read).
    fn run(
        &self,
        log: &OrderedLog<T>,
        mut first: Option<(&Message<T>, u64)>,
        mut seen: usize,
    ) -> Outcome {
        let mut tally = Outcome::default();
        let mut read = Read::default();
        loop {
            let cursor = self.cursor.load(Ordering::Relaxed);
            match first.take() {
                Some((message, position)) if position == cursor => {
                    tally.add(self.call_unless_pushed_out(log, position, message));
                    self.cursor.store(position + 1, Ordering::Release);
                }
                _ => {
                    if cursor < log.head() {
                        let (mut refusals, mut counted) = (false, 0);
                        log.read(cursor, &mut read, |start, end| {
                            // Positions it read are not noted from now on,
                            // nor forgotten: what is noted is known here.
                            self.read_to.store(end, Ordering::Relaxed);
                            refusals = self.refused.any();
                            if refusals {
                                counted = self.refused.passed(start);
                            }
                        });
                        // Pushed out of the ring before this runner got to
                        // them (lost, unless the subscription left: skipped;
                        // a refused one was counted when it was refused).
                        let lost = (read.start() - cursor).saturating_sub(counted);
                        if self.active.load(Ordering::Acquire) {
                            tally.dropped += u32::try_from(lost).unwrap_or(u32::MAX);
                        }
                        for (position, message) in read.messages() {
                            // A refused one was counted when it was refused.
                            if !(refusals && self.refused.take(position)) {
                                // Maybe published from inside this runner's
                                // own call: as deep as that publish runs.
                                let _deeper = (message.inline_depth() > 0)
                                    .then(|| InlineAtLeast::enter(message.inline_depth()));
                                tally.add(self.call_unless_pushed_out(log, position, message));
                            }
                            self.cursor.store(position + 1, Ordering::Release);
                        }
                        read.clear();
                    }
                }
            }
            match self
                .pending
                .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                // More arrived: their messages are appended; catch up. A
                // runner that publishers keep feeding may run for long:
                // between rounds it lets a grace period in progress (an
                // `unsubscribe_and_wait` of any subscription) stop waiting
                // for it. Its next call checks the flag again.
                Err(now) => {
                    seen = now;
                    if let Some(quiescence) = self.quiescence.get() {
                        quiescence.renew_if_outermost();
                    }
                }
            }
        }
        tally
    }

    /// [`Self::call`], or a drop if the log has pushed the message out
    /// meanwhile: the handler fell more than the log's capacity behind
    /// (while it ran an earlier message, newer ones kept coming).
    #[inline]
    fn call_unless_pushed_out(
        &self,
        log: &OrderedLog<T>,
        position: u64,
        message: &Message<T>,
    ) -> Call {
        if log.pushed_out(position) {
            return self.dropped_or_skipped();
        }
        self.call(message)
    }

    /// A message pushed out of the log: lost, unless the subscription left.
    fn dropped_or_skipped(&self) -> Call {
        if self.active.load(Ordering::Acquire) {
            Call::Dropped
        } else {
            Call::Skipped
        }
    }

    /// Whether `message` was in the snapshot the subscription started with
    /// (a live copy of it is not run again).
    #[inline(always)]
    fn in_snapshot(&self, message: &Message<T>) -> bool {
        self.after != 0 && message.seq() != 0 && message.seq() <= self.after
    }

    /// One message: the handler's call; skipped once removed.
    #[inline(always)]
    fn call(&self, message: &Message<T>) -> Call {
        if !self.active.load(Ordering::Acquire) {
            return Call::Skipped;
        }
        if self.in_snapshot(message) {
            // The snapshot's call ran it, and was counted.
            return Call::Skipped;
        }
        match catch_unwind(AssertUnwindSafe(|| (self.handler)(message))) {
            Ok(()) => Call::Delivered,
            Err(panic) => {
                report_panic(message.topic(), Some(self.id), panic.as_ref());
                Call::Panicked
            }
        }
    }
}

impl<T, H> Sink<T> for OrderedSink<T, H>
where
    T: Send + Sync + 'static,
    H: Fn(&Message<T>) + Send + Sync + 'static,
{
    /// Not reached: ordered subscriptions are not shared, and run their
    /// snapshot themselves, so only a publish's job delivers to them,
    /// through [`Sink::deliver_at`].
    /// A message without a position in the log has nothing to run.
    fn deliver(&self, _message: &Arc<Message<T>>) -> Option<BoxFuture> {
        None
    }

    #[inline]
    fn deliver_at(
        &self,
        message: &Arc<Message<T>>,
        position: u64,
        settled: &mut Settled,
    ) -> Option<BoxFuture> {
        match self.log.get() {
            Some(log) if self.arrive(position) => {
                self.deliver_as_runner(log, message, position, settled);
            }
            _ => settled.settle(Outcome::default()),
        }
        None
    }

    #[inline]
    fn deliver_batch(&self, batch: &[(&Arc<Message<T>>, u64)], settled: &mut Settled) -> bool {
        let mut outcome = Outcome::default();
        if let Some(log) = self.log.get() {
            let cursor = self.cursor.load(Ordering::Acquire);
            // Counted in once for the batch, if any of it is left to run.
            if batch
                .iter()
                .any(|&(_, position)| position != NO_POSITION && position >= cursor)
                && self.pending.fetch_add(1, Ordering::AcqRel) == 0
            {
                outcome = self.run_batch(log, batch);
            }
        }
        settled.settle_many(batch.len(), outcome);
        true
    }

    fn discard_at(&self, message: &Message<T>, position: u64) -> Option<Outcome> {
        let mut tally = Outcome::default();
        let Some(log) = self.log.get() else {
            return Some(tally);
        };
        if position == NO_POSITION {
            return Some(tally);
        }
        let noted = log.while_appends_wait(|| {
            let read_to = self.read_to.load(Ordering::Relaxed);
            // Run, or read by a runner that will run it.
            if self.cursor.load(Ordering::Acquire) > position || read_to > position {
                return false;
            }
            self.refused.note(position, log.oldest_kept(), read_to);
            true
        });
        if noted {
            // Not lost if the subscription left, or if its snapshot ran it.
            tally.add(
                if !self.active.load(Ordering::Acquire) || self.in_snapshot(message) {
                    Call::Skipped
                } else {
                    Call::Dropped
                },
            );
        }
        Some(tally)
    }
}

impl<T, H> Drop for OrderedSink<T, H> {
    fn drop(&mut self) {
        if let Some(log) = self.log.get() {
            log.release_if_unread();
        }
    }
}

impl<T, H> Tracked for OrderedSink<T, H> {
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

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};

    use super::OrderedSink;
    use crate::message::Message;
    use crate::registry::entry::{Outcome, Settled, Sink};
    use crate::registry::ordered_log::OrderedLog;

    fn deliver(sink: &impl Sink<u32>, log: &OrderedLog<u32>, value: u32) -> Outcome {
        let message = Arc::new(Message::new("t", value));
        let position = log.append(&message);
        let mut settled = Settled::default();
        assert!(
            sink.deliver_at(&message, position, &mut settled).is_none(),
            "an ordered sink is sync"
        );
        if settled.deliveries == 0 {
            return Outcome {
                delivered: 1,
                ..Outcome::default()
            };
        }
        let count = |n: u64| u32::try_from(n).unwrap();
        Outcome {
            delivered: count(settled.delivered),
            panics: count(settled.panics),
            dropped: count(settled.dropped),
        }
    }

    /// A runner that copied messages from the log and then blocked in a
    /// call does not run the copies the log pushed out meanwhile: the
    /// bound is the log's capacity, and what it pushed out counts dropped.
    #[test]
    fn copies_pushed_out_of_the_log_are_dropped_not_run() {
        let log = Arc::new(OrderedLog::<u32>::new(4));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (blocked_tx, blocked) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let release_rx = Mutex::new(release_rx);
        let sink = {
            let seen = Arc::clone(&seen);
            Arc::new(OrderedSink::new(
                move |m: &Message<u32>| {
                    if *m.data() == 0 {
                        blocked_tx.send(()).unwrap();
                        release_rx.lock().unwrap().recv().unwrap();
                    }
                    seen.lock().unwrap().push(*m.data());
                },
                1,
            ))
        };
        sink.attach(
            Arc::clone(&log),
            Arc::new(crate::registry::quiesce::Quiescence::new()),
        );
        // Position 0 is appended without a delivery, so the delivery of 1
        // becomes the runner through the log: it copies 0 and 1, then
        // blocks in the call for 0.
        log.append(&Arc::new(Message::new("t", 0)));
        let runner = {
            let (sink, log) = (Arc::clone(&sink), Arc::clone(&log));
            std::thread::spawn(move || deliver(&*sink, &log, 1))
        };
        blocked.recv().unwrap();
        // Six more while it is blocked: the log keeps 4..7 only.
        for value in 2..8 {
            let early = deliver(&*sink, &log, value);
            assert_eq!(early, Outcome::default(), "the runner runs these");
        }
        release.send(()).unwrap();
        let outcome = runner.join().unwrap();
        assert_eq!(*seen.lock().unwrap(), [0, 4, 5, 6, 7]);
        assert_eq!((outcome.delivered, outcome.dropped), (5, 3));
    }

    /// The values a recording sink ran, in order.
    type Seen = Arc<Mutex<Vec<u32>>>;

    /// A sink reading `log` that records the values it runs.
    fn recording(log: &Arc<OrderedLog<u32>>) -> (impl Sink<u32>, Seen) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let seen = Arc::clone(&seen);
            OrderedSink::new(
                move |m: &Message<u32>| seen.lock().unwrap().push(*m.data()),
                1,
            )
        };
        sink.attach(
            Arc::clone(log),
            Arc::new(crate::registry::quiesce::Quiescence::new()),
        );
        (sink, seen)
    }

    /// A batch whose oldest messages the log pushed out before it ran
    /// counts those dropped and runs the rest, in order: the bound holds
    /// for batches too.
    #[test]
    fn a_batch_drops_what_the_log_pushed_out_before_it_ran() {
        let log = Arc::new(OrderedLog::<u32>::new(2));
        let (sink, seen) = recording(&log);
        let messages: Vec<_> = (0..5).map(|v| Arc::new(Message::new("t", v))).collect();
        let batch: Vec<_> = messages.iter().map(|m| (m, log.append(m))).collect();
        let mut settled = Settled::default();
        assert!(sink.deliver_batch(&batch, &mut settled));
        assert_eq!(*seen.lock().unwrap(), [3, 4]);
        assert_eq!(
            (settled.deliveries, settled.delivered, settled.dropped),
            (5, 2, 3)
        );
    }

    /// A batch runs its messages in order as one runner; a message between
    /// two of its own (a publish not in the batch) is caught up from the
    /// log; messages already run are skipped and the batch still settles
    /// every delivery it was given.
    #[test]
    fn a_batch_runs_in_order_and_catches_up_on_a_gap() {
        let log = Arc::new(OrderedLog::<u32>::new(16));
        let (sink, seen) = recording(&log);
        let messages: Vec<_> = (0..4).map(|v| Arc::new(Message::new("t", v))).collect();
        let positions: Vec<_> = messages.iter().map(|m| log.append(m)).collect();
        let batch: Vec<_> = [0, 1, 3]
            .iter()
            .map(|&i| (&messages[i], positions[i]))
            .collect();
        let mut settled = Settled::default();
        assert!(sink.deliver_batch(&batch, &mut settled));
        assert_eq!(*seen.lock().unwrap(), [0, 1, 2, 3]);
        assert_eq!((settled.deliveries, settled.delivered), (3, 4));
        let mut again = Settled::default();
        assert!(sink.deliver_batch(&batch[1..2], &mut again));
        assert_eq!((again.deliveries, again.delivered), (1, 0), "already run");
        assert_eq!(seen.lock().unwrap().len(), 4);
    }
}
