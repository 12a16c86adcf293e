//! Counters: the [`Stats`] snapshot users read, and the atomics behind it.
//!
//! Every delivery ends in exactly one of: delivered, dropped (by an overflow
//! policy the user chose, or a full stream mailbox), a caught handler panic,
//! or skipped because its subscription was removed first; a stream message
//! may also still sit unread in its mailbox. So once a bus is quiet and its
//! streams read, `delivered + dropped + handler_panics` accounts for every
//! delivery to a subscription that lived through its publish.
//!
//! The counters also carry the close barrier, in one atomic word (`work`):
//! a `CLOSED` bit, a count of publish *tokens* (one per publish between its
//! admission and its hand-off) and a count of accepted deliveries not yet
//! finished, in separate bit fields. A publish is admitted by adding its
//! token and reading the bit in the same atomic add, and hands off by turning
//! its token into its deliveries in one more; `close` sets the bit with one atomic or and then
//! waits for the count to reach zero. Because both facts live in one word,
//! every operation on it is totally ordered: either the publish saw the bit
//! and backs out, or `close` counts it and waits for it. (Two separate
//! atomics would need a sequentially consistent fence on each side for the
//! same guarantee.) Whoever brings the count to zero after the bit is set
//! sees exactly that transition in its atomic's result and wakes the waiter.
//!
//! Workers add their tallies once per unit of work, not per delivery, so the
//! hot loop touches no shared counter.

use std::cell::{Cell, RefCell};
use std::sync::OnceLock;
use std::time::Duration;

use crossbeam_utils::CachePadded;

use crate::error::Error;
use crate::sync::{AtomicBool, AtomicU64, Condvar, Mutex, Ordering};

/// A snapshot of a bus's counters, from [`Bus::stats`](crate::Bus::stats).
///
/// Counts are totals since the bus was built. Under concurrent activity the
/// fields are read one after another, not as one atomic snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Publishes the bus accepted and fanned out: a valid topic on an open
    /// bus, with room in every lossless stream it reaches and (in `Inline`
    /// mode) not nested too deep, including ones that returned
    /// `Error::Overloaded`. A publish refused with `Error::Full` or
    /// `Error::RecursionLimit` is not counted.
    pub published: u64,
    /// Deliveries completed: handler calls that returned (for async handlers,
    /// whose future completed) and messages stream receivers took.
    pub delivered: u64,
    /// Deliveries lost to a policy: refused under `Overflow::Drop` or
    /// `Overflow::Error`, pushed out of a full stream mailbox by a newer
    /// message, arriving at a mailbox already closed, left unread in a
    /// mailbox when its `Receiver` was dropped, an async delivery past twice
    /// the task cap from a publisher that cannot block for it (see
    /// [`Config::max_inflight_tasks`](crate::Config::max_inflight_tasks)),
    /// or one the runtime dropped as it shut down.
    pub dropped: u64,
    /// Handler calls that panicked. The panic was caught; nobody else noticed.
    pub handler_panics: u64,
    /// Units of work a publisher ran itself because the pool's queue or the
    /// task cap was full: under `Overflow::CallerRuns`, and under the
    /// default `Overflow::Wait` where waiting could deadlock (a publish from
    /// a handler or a pool worker, a closing bus, no free task slot, a
    /// stalled worker driving an async handler's future); also the jobs of
    /// requests made on a pool worker that run there
    /// ([`Bus::request`](crate::Bus::request)).
    /// A unit, not an
    /// async handler's future: an `Inline` publisher that finishes a
    /// pending future itself at the task cap ran no unit of another's, and
    /// is not counted here.
    pub caller_runs: u64,
    /// Deliveries accepted but not yet finished (as
    /// [`Bus::inflight_messages`](crate::Bus::inflight_messages)).
    pub inflight: u64,
    /// Live subscriptions (as
    /// [`Bus::subscriptions_count`](crate::Bus::subscriptions_count)),
    /// shared-group members included.
    pub subscriptions: u64,
    /// Stream subscriptions closed because a message did not fit
    /// ([`StreamOverflow::Disconnect`](crate::StreamOverflow::Disconnect));
    /// the message that did not fit is in `dropped`.
    pub disconnects: u64,
    /// `Inline` publishes refused because handlers nested publishes too deep
    /// (`Error::RecursionLimit`).
    pub recursion_refused: u64,
    /// Topics retained now ([`Bus::publish_retained`](crate::Bus::publish_retained)),
    /// expired ones removed first.
    pub retained: u64,
    /// Retained messages evicted to keep within
    /// [`Config::max_retained`](crate::Config::max_retained) (the topic
    /// retained least recently goes first).
    pub retained_evicted: u64,
    /// Retained messages removed because
    /// [`Config::retained_expiry`](crate::Config::retained_expiry) passed.
    pub retained_expired: u64,
    /// Replies that found no request waiting ([`Bus::reply`](crate::Bus::reply)
    /// to a request that had already ended: answered, timed out or
    /// cancelled). Dropped, and counted here.
    pub late_replies: u64,
}

/// The `work` word: bit 63 is `CLOSED`, bits 40–62 count publish tokens,
/// bits 0–39 count deliveries in flight (up to about 10^12).
const CLOSED: u64 = 1 << 63;
/// One publish token.
const TOKEN: u64 = 1 << 40;
/// The deliveries field.
const DELIVERIES: u64 = TOKEN - 1;

/// The shared atomics. Hot ones get a cache line each.
pub(crate) struct Counters {
    published: CachePadded<AtomicU64>,
    delivered: CachePadded<AtomicU64>,
    dropped: AtomicU64,
    handler_panics: AtomicU64,
    caller_runs: AtomicU64,
    disconnects: AtomicU64,
    recursion_refused: AtomicU64,
    /// Live lossless (`Backpressure`) stream subscriptions: while there are
    /// none, a publish skips reserving room.
    lossless_streams: AtomicU64,
    /// Deliveries a runner counted as delivered that a shared group's member
    /// turned into something else (a push into another member's mailbox,
    /// counted when read; or a drop, counted as dropped), or that a primed
    /// handler counts again when it runs them; subtracted from `delivered`.
    retracted: AtomicU64,
    pub(crate) retained_evicted: AtomicU64,
    pub(crate) retained_expired: AtomicU64,
    pub(crate) late_replies: AtomicU64,
    /// `CLOSED` | publish tokens | deliveries in flight; see [`CLOSED`].
    work: CachePadded<AtomicU64>,
    drain_lock: Mutex<()>,
    drained: Condvar,
    /// What closing does once everything accepted has finished (end the
    /// streams, stop the workers); set by the first `close`. Run by whoever
    /// drains the bus, so it happens even if every `close` future was
    /// dropped or timed out.
    on_drained: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Set (under `drain_lock`) once `on_drained` has run to its end: a
    /// waiter that sees the work drained returns only then, so the streams
    /// have ended when `close` returns, also when another thread drained
    /// the bus a moment before.
    finished: AtomicBool,
}

thread_local! {
    /// Publish tokens held by this thread's stack: publishes it is in the
    /// middle of (a handler run before its publish hands off, as a shared
    /// group's or a retained snapshot's, may close the bus), per bus, by
    /// its counters' address. A publish takes and gives back its token
    /// with no other bus's publish in between but for a handler's, so one
    /// cell holds the bus whose tokens the stack took first, and the rare
    /// other buses, nested inside, spill into a list.
    static TOKENS_HERE: Cell<(usize, u64)> = const { Cell::new((0, 0)) };
    static TOKENS_NESTED: RefCell<Vec<(usize, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Publish tokens of `counters`' bus this thread's stack holds (see
/// `Bus::close`).
pub(crate) fn tokens_here(counters: &Counters) -> u64 {
    let bus = counters.key();
    match TOKENS_HERE.with(Cell::get) {
        (first, tokens) if first == bus => tokens,
        _ => TOKENS_NESTED.with(|nested| {
            nested
                .borrow()
                .iter()
                .find(|(b, _)| *b == bus)
                .map_or(0, |(_, tokens)| *tokens)
        }),
    }
}

#[inline]
fn token_taken(bus: usize) {
    TOKENS_HERE.with(|here| match here.get() {
        (first, tokens) if first == bus || tokens == 0 => here.set((bus, tokens + 1)),
        _ => change_nested(bus, |tokens| *tokens += 1),
    });
}

#[inline]
fn token_given_back(bus: usize) {
    TOKENS_HERE.with(|here| match here.get() {
        (first, tokens) if first == bus => here.set((first, tokens.saturating_sub(1))),
        _ => change_nested(bus, |tokens| *tokens = tokens.saturating_sub(1)),
    });
}

/// The rare path of [`token_taken`] and [`token_given_back`]: a bus other
/// than the first on this stack.
#[cold]
fn change_nested(bus: usize, change: impl FnOnce(&mut u64)) {
    TOKENS_NESTED.with(|nested| {
        let mut nested = nested.borrow_mut();
        let index = match nested.iter().position(|(b, _)| *b == bus) {
            Some(index) => index,
            None => {
                nested.push((bus, 0));
                nested.len() - 1
            }
        };
        change(&mut nested[index].1);
        if nested[index].1 == 0 {
            nested.swap_remove(index);
        }
    });
}

/// An admitted publish: its token keeps `close` waiting until the publish has
/// handed its deliveries over (or, with none to hand over, has finished).
pub(crate) struct PublishGuard<'a> {
    counters: &'a Counters,
    token_held: bool,
}

impl PublishGuard<'_> {
    /// Counts `deliveries` as in flight before they are handed to runners;
    /// the publish's token becomes one of them.
    pub(crate) fn accept(&mut self, deliveries: usize) {
        if deliveries == 0 || !self.token_held {
            return;
        }
        // Adds the deliveries and removes the token in one step (wrapping
        // arithmetic: the token field is at least one, so nothing borrows
        // into the closed bit).
        self.counters
            .work
            .fetch_add((deliveries as u64).wrapping_sub(TOKEN), Ordering::AcqRel);
        self.token_held = false;
        token_given_back(self.counters.key());
    }
}

impl PublishGuard<'_> {
    /// Counts `deliveries` more as in flight while the publish still holds
    /// its token (ordered handlers' queued messages, before they are
    /// queued: a drain may finish them at once).
    pub(crate) fn extend(&mut self, deliveries: u64) {
        debug_assert!(self.token_held, "extend after the token was handed off");
        self.counters.work.fetch_add(deliveries, Ordering::AcqRel);
    }
}

impl Drop for PublishGuard<'_> {
    fn drop(&mut self) {
        if self.token_held {
            token_given_back(self.counters.key());
            self.counters.release(TOKEN);
        }
    }
}

/// What one runner did with its share of a publish, added to [`Counters`] in
/// one go when it finishes.
#[derive(Default, Debug)]
pub(crate) struct Tally {
    /// Deliveries finished (whatever their outcome): leaves `inflight`.
    pub(crate) finished: u64,
    pub(crate) delivered: u64,
    pub(crate) dropped: u64,
    pub(crate) panics: u64,
}

impl Counters {
    pub(crate) fn new() -> Self {
        Self {
            published: CachePadded::new(AtomicU64::new(0)),
            delivered: CachePadded::new(AtomicU64::new(0)),
            dropped: AtomicU64::new(0),
            handler_panics: AtomicU64::new(0),
            caller_runs: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
            recursion_refused: AtomicU64::new(0),
            lossless_streams: AtomicU64::new(0),
            retracted: AtomicU64::new(0),
            retained_evicted: AtomicU64::new(0),
            retained_expired: AtomicU64::new(0),
            late_replies: AtomicU64::new(0),
            work: CachePadded::new(AtomicU64::new(0)),
            drain_lock: Mutex::new(()),
            drained: Condvar::new(),
            on_drained: OnceLock::new(),
            finished: AtomicBool::new(false),
        }
    }

    /// This bus's key in the per-thread token counts: its address, stable
    /// while any publish holds a token (it borrows these counters).
    #[inline]
    fn key(&self) -> usize {
        self as *const Self as usize
    }

    /// Admits a publish unless the bus is closed.
    pub(crate) fn begin_publish(&self) -> Result<PublishGuard<'_>, Error> {
        let before = self.work.fetch_add(TOKEN, Ordering::AcqRel);
        if before & CLOSED != 0 {
            self.release(TOKEN);
            return Err(Error::Closed);
        }
        token_taken(self.key());
        Ok(PublishGuard {
            counters: self,
            token_held: true,
        })
    }

    /// Retires `n` (deliveries, or a `TOKEN`), waking `close` if that was the
    /// last outstanding work after it began.
    fn release(&self, n: u64) {
        let before = self.work.fetch_sub(n, Ordering::AcqRel);
        if before == CLOSED | n {
            self.drained_now();
        }
    }

    /// The bus is closed and nothing is outstanding: finish closing and wake
    /// the waiters. May run more than once (a publish refused after the
    /// drain passes through zero again); what it runs is idempotent.
    fn drained_now(&self) {
        if let Some(finish) = self.on_drained.get() {
            finish();
        }
        // Taking the lock orders this wake-up after the waiter's check.
        let _guard = self.drain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.finished.store(true, Ordering::Release);
        self.drained.notify_all();
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.work.load(Ordering::Acquire) & CLOSED != 0
    }

    pub(crate) fn published(&self) {
        self.published.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(&self, tally: &Tally) {
        if tally.delivered > 0 {
            self.delivered.fetch_add(tally.delivered, Ordering::Relaxed);
        }
        if tally.dropped > 0 {
            self.dropped.fetch_add(tally.dropped, Ordering::Relaxed);
        }
        if tally.panics > 0 {
            self.handler_panics
                .fetch_add(tally.panics, Ordering::Relaxed);
        }
        if tally.finished > 0 {
            self.release(tally.finished);
        }
    }

    /// A stream receiver took a message from its mailbox.
    pub(crate) fn received_from_stream(&self) {
        self.delivered.fetch_add(1, Ordering::Relaxed);
    }

    /// Messages dropped on the publisher's thread (full or closed mailboxes).
    pub(crate) fn dropped_now(&self, dropped: u64) {
        self.dropped.fetch_add(dropped, Ordering::Relaxed);
    }

    /// A mailbox closed under `StreamOverflow::Disconnect`.
    pub(crate) fn disconnected(&self) {
        self.disconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// An `Inline` publish refused for nesting too deep.
    pub(crate) fn recursion_refused(&self) {
        self.recursion_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn lossless_added(&self) {
        self.lossless_streams.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn lossless_removed(&self) {
        self.lossless_streams.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether a publish must reserve room in lossless mailboxes.
    #[inline]
    pub(crate) fn has_lossless_streams(&self) -> bool {
        self.lossless_streams.load(Ordering::SeqCst) > 0
    }

    /// Takes back `n` deliveries a runner will count (or has counted) as
    /// delivered; see `retracted`.
    pub(crate) fn retract_delivered(&self, n: u64) {
        self.retracted.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn caller_ran(&self) {
        self.caller_runs.fetch_add(1, Ordering::Relaxed);
    }

    /// Deliveries accepted and not finished.
    pub(crate) fn inflight(&self) -> u64 {
        self.work.load(Ordering::Acquire) & DELIVERIES
    }

    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            published: self.published.load(Ordering::Relaxed),
            // Retractions come after (or just before) the count they take
            // back; never report below zero meanwhile.
            delivered: self
                .delivered
                .load(Ordering::Relaxed)
                .saturating_sub(self.retracted.load(Ordering::Relaxed)),
            dropped: self.dropped.load(Ordering::Relaxed),
            handler_panics: self.handler_panics.load(Ordering::Relaxed),
            caller_runs: self.caller_runs.load(Ordering::Relaxed),
            inflight: self.inflight(),
            // Filled in by the bus, which owns the trie that counts them.
            subscriptions: 0,
            disconnects: self.disconnects.load(Ordering::Relaxed),
            recursion_refused: self.recursion_refused.load(Ordering::Relaxed),
            retained: 0,
            retained_evicted: self.retained_evicted.load(Ordering::Relaxed),
            retained_expired: self.retained_expired.load(Ordering::Relaxed),
            late_replies: self.late_replies.load(Ordering::Relaxed),
        }
    }

    /// Refuses new publishes from now on. `on_drained` (kept from the first
    /// call only) runs once everything accepted has finished: here, if that
    /// is already so, or else by whichever runner finishes the last delivery.
    pub(crate) fn close(&self, on_drained: impl Fn() + Send + Sync + 'static) {
        // Installed before the bit is set, so the drain cannot miss it.
        let _ = self.on_drained.set(Box::new(on_drained));
        let before = self.work.fetch_or(CLOSED, Ordering::AcqRel);
        if before & !CLOSED == 0 {
            self.drained_now();
        }
    }

    /// Blocks until the bus is closed and everything accepted has finished,
    /// or `timeout` passes.
    pub(crate) fn wait_drained(&self, timeout: Duration) -> Result<(), Error> {
        self.wait_drained_unless(timeout, &std::sync::atomic::AtomicBool::new(false))
    }

    /// [`Self::wait_drained`], giving up (`Err(Error::Closed)`) once
    /// `abandoned` is set and [`Self::wake_waiters`] called: the `close`
    /// future that waits on this was dropped.
    pub(crate) fn wait_drained_unless(
        &self,
        timeout: Duration,
        abandoned: &std::sync::atomic::AtomicBool,
    ) -> Result<(), Error> {
        let started = crate::sync::now();
        let mut guard = self.drain_lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.work.load(Ordering::Acquire) == CLOSED && self.finished.load(Ordering::Acquire)
            {
                return Ok(());
            }
            if abandoned.load(std::sync::atomic::Ordering::Acquire) {
                return Err(Error::Closed);
            }
            let waited = crate::sync::now().saturating_duration_since(started);
            if waited >= timeout {
                return Err(Error::CloseTimeout {
                    waited,
                    inflight: self.inflight(),
                });
            }
            guard = self
                .drained
                .wait_timeout(guard, timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Blocks until everything accepted has finished except what the
    /// caller's own stack holds (`own()`: publishes in progress and
    /// deliveries, as of now: a handler closing the bus), or `timeout`
    /// passes. Polls: this path is for the rare close from inside a
    /// handler.
    pub(crate) fn wait_drained_except(
        &self,
        own: impl Fn() -> (u64, u64),
        timeout: Duration,
        abandoned: &std::sync::atomic::AtomicBool,
    ) -> Result<(), Error> {
        let started = crate::sync::now();
        loop {
            if abandoned.load(std::sync::atomic::Ordering::Acquire) {
                return Err(Error::Closed);
            }
            let work = self.work.load(Ordering::Acquire);
            // Read after the word: once the poll `close` was called in has
            // returned, the caller holds only its own delivery, and a word
            // read before that still counts everything it held then.
            let (own_tokens, own_deliveries) = own();
            let tokens = (work & !CLOSED) >> TOKEN.trailing_zeros();
            if tokens <= own_tokens && work & DELIVERIES <= own_deliveries {
                return Ok(());
            }
            let waited = crate::sync::now().saturating_duration_since(started);
            if waited >= timeout {
                return Err(Error::CloseTimeout {
                    waited,
                    inflight: self.inflight(),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Wakes the threads in [`Self::wait_drained_unless`], to look at their
    /// `abandoned` flag.
    pub(crate) fn wake_waiters(&self) {
        // Taking the lock orders this wake-up after a waiter's check.
        let _guard = self.drain_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.drained.notify_all();
    }

    /// [`Self::close`] with nothing to finish, then [`Self::wait_drained`].
    #[cfg(all(test, loom))]
    pub(crate) fn close_and_wait(&self, timeout: Duration) -> Result<(), Error> {
        self.close(|| {});
        self.wait_drained(timeout)
    }
}
