//! [`Intake`]: every message the NATS client dropped for a slow consumer,
//! counted. async-nats reports each such drop as an event, into a channel
//! of 128 that discards events when it is full: a burst to a node whose
//! subscriber tasks fall behind (a current-thread runtime) lost most of
//! the count that way.
//!
//! # Contract
//! - The client counts every message its connection receives
//!   (`Statistics::in_messages`). Each goes to its subscription's channel,
//!   or is dropped when that channel is full. The bridge's subscriber tasks
//!   count every message they take (`taken`). When nothing waits in those
//!   channels, `in_messages - taken` is exactly what the client dropped;
//!   what is not yet counted of it is added to `dropped` and
//!   `slow_consumers`.
//! - "Nothing waits" is observed: every subscriber task found its channel
//!   empty at its last poll (`busy` is 0), and neither count moved for a
//!   whole tick ([`TICK`]). A message that arrived in the tick moved
//!   `in_messages`. One that arrived earlier and whose task has not run for
//!   a whole tick since would be counted dropped and then delivered: it
//!   takes a subscriber task starved for [`TICK`] after its channel was
//!   found empty.
//! - A subscription that ends drains (async-nats `drain`: unsubscribe,
//!   then take what is already on its way), so every message of its
//!   subject is taken or dropped, and none is left to look lost. A drain
//!   that cannot finish (the connection down) is given up after
//!   [`DRAIN_LIMIT`]; what it left is counted dropped.
//! - Closing: once the client has drained and the subscriber tasks have
//!   ended, a last count settles the rest.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::stats::Counters;

/// How long both counts must stand still, every channel empty, before the
/// difference is counted.
pub(crate) const TICK: Duration = Duration::from_millis(250);

/// How long an ended subscription's drain may take.
pub(crate) const DRAIN_LIMIT: Duration = Duration::from_secs(5);

pub(crate) struct Intake {
    received: Arc<async_nats::Statistics>,
    /// Messages the subscriber tasks took from the client.
    taken: AtomicU64,
    /// Subscriber tasks that may have messages waiting: not parked on an
    /// empty channel since their last message.
    busy: AtomicUsize,
    /// Subscriber tasks alive.
    alive: AtomicUsize,
    /// The client's drops counted so far.
    counted: AtomicU64,
    stats: Arc<Counters>,
}

impl Intake {
    pub(crate) fn new(received: Arc<async_nats::Statistics>, stats: Arc<Counters>) -> Arc<Self> {
        let intake = Arc::new(Self {
            received,
            taken: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            alive: AtomicUsize::new(0),
            counted: AtomicU64::new(0),
            stats,
        });
        tokio::spawn(watch(Arc::downgrade(&intake)));
        intake
    }

    /// A subscriber task's marks, from its start (busy until its first
    /// empty poll) to its end.
    pub(crate) fn task(self: &Arc<Self>) -> TaskMark {
        self.alive.fetch_add(1, Ordering::SeqCst);
        self.busy.fetch_add(1, Ordering::SeqCst);
        TaskMark {
            intake: Arc::clone(self),
            busy: true,
        }
    }

    fn snapshot(&self) -> (u64, u64) {
        (
            self.received.in_messages.load(Ordering::SeqCst),
            self.taken.load(Ordering::SeqCst),
        )
    }

    /// Counts what the client dropped and is not counted yet; call only
    /// when nothing waits in the channels.
    fn count_dropped(&self, (received, taken): (u64, u64)) {
        let dropped = received.saturating_sub(taken);
        let before = self.counted.fetch_max(dropped, Ordering::AcqRel);
        if dropped > before {
            let new = dropped - before;
            Counters::add(&self.stats.dropped, new);
            Counters::add(&self.stats.slow_consumers, new);
            tracing::warn!(
                dropped = new,
                "NATS slow consumer: the client dropped messages for the bridge"
            );
        }
    }

    /// The last count, at close (after the client drained): waits for the
    /// subscriber tasks to end (a short while at most), then counts.
    pub(crate) async fn settle_at_close(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while self.alive.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.count_dropped(self.snapshot());
    }
}

/// Counts the client's drops whenever the intake has stood still, empty,
/// for a tick; ends with the intake.
async fn watch(intake: Weak<Intake>) {
    let mut last = None;
    loop {
        tokio::time::sleep(TICK).await;
        let Some(intake) = intake.upgrade() else {
            return;
        };
        let quiet = intake.busy.load(Ordering::SeqCst) == 0;
        let now = intake.snapshot();
        if quiet && last == Some(now) {
            intake.count_dropped(now);
        }
        last = quiet.then_some(now);
    }
}

/// One subscriber task's part in the counts.
pub(crate) struct TaskMark {
    intake: Arc<Intake>,
    busy: bool,
}

impl TaskMark {
    /// The task took a message from its channel.
    pub(crate) fn took(&mut self) {
        if !self.busy {
            self.busy = true;
            self.intake.busy.fetch_add(1, Ordering::SeqCst);
        }
        self.intake.taken.fetch_add(1, Ordering::SeqCst);
    }

    /// The task found its channel empty.
    pub(crate) fn idle(&mut self) {
        if self.busy {
            self.busy = false;
            self.intake.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for TaskMark {
    fn drop(&mut self) {
        self.idle();
        self.intake.alive.fetch_sub(1, Ordering::SeqCst);
    }
}
