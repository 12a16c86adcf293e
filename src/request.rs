//! Request/reply: a request is a publish that carries a reply topic, and a
//! reply is a publish to it (MQTT 5 §4.10's response topic; NATS's inbox).
//!
//! # Contract
//! - [`Bus::request`] subscribes a stream to a fresh reply topic,
//!   `$reply/{bus}/{n}` (a `$` topic, so `#` and `+/...` subscribers never
//!   see replies; unique to the request), publishes the request with
//!   [`Message::reply_to`] set to it, and waits for the first reply.
//!   [`Bus::request_many`] waits for up to `max` replies; `usize::MAX`
//!   takes as many as come by the deadline.
//! - **Replies queue in a bounded mailbox** of `min(max,
//!   MAX_QUEUED_REPLIES)` (4,096) replies until the request takes them, so a
//!   large `max` allocates no room for replies that never come. The request
//!   takes them as they come; only a burst that outruns it by more than
//!   that (more responders than that answering inside an `Inline` publish)
//!   loses the newest of them (the first replies are kept), counted in
//!   `Stats::dropped` as any full mailbox's are.
//! - **Nobody to answer**: if the request matched no subscription, it fails
//!   at once with [`Error::NoResponders`], without waiting for the deadline.
//! - **Deadline**: with no reply by `timeout`, [`Error::Timeout`]
//!   (`request_many` returns the replies it has, if any). The deadline is
//!   kept by the bus's own timer thread (started on the first request), so a
//!   request needs no tokio timer and works on any executor.
//! - **The reply subscription is gone when the request ends**, however it
//!   ends: answered, timed out, failed, or its future dropped (cancelling a
//!   request is safe and leaves nothing subscribed). A reply that comes
//!   later matches nothing; [`Bus::reply`] counts it in
//!   [`Stats::late_replies`](crate::Stats::late_replies). Replies beyond
//!   what a request takes (a second reply to `request`) are dropped with its
//!   mailbox and counted in `Stats::dropped`.
//! - **An ended request costs no memory**: its deadline is disarmed too,
//!   and the timer's heap holds at most `2 × waiting + 64` entries, whatever
//!   the timeouts (a disarmed deadline is not left to linger until it would
//!   have passed).
//! - A request to a shared subscription (`$share/{group}/{filter}`) reaches
//!   one member: a load-balanced service.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::bus::Bus;
use crate::dispatch::publish_in_place;
use crate::error::Error;
use crate::handles::Receiver;
use crate::message::Message;
use crate::registry::route::Route;
use crate::stream_options::StreamOverflow;
use crate::sync::{AtomicBool, AtomicU64, Ordering, WakerSlot};
use crate::topic::{split_shared, validate_filter, validate_topic};

/// The first level of every reply topic.
const REPLY_ROOT: &str = "$reply";

/// The most replies a request's mailbox holds before the request takes
/// them (its allocation: 64 KiB at 16 bytes a slot). Taken as they come, so
/// only a burst from more than this many responders at once outruns it, and
/// a request with a `max` of millions costs no more than this.
const MAX_QUEUED_REPLIES: usize = 4_096;

/// Distinguishes the reply topics of buses in one process.
static BUSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A bus's requests: reply-topic numbering and the deadline timer.
pub(crate) struct Requests {
    bus: u64,
    next: AtomicU64,
    timer: OnceLock<Result<Timer, String>>,
}

impl Requests {
    pub(crate) fn new() -> Self {
        Self {
            bus: BUSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            next: AtomicU64::new(1),
            timer: OnceLock::new(),
        }
    }

    fn reply_topic(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{REPLY_ROOT}/{}/{n}", self.bus)
    }

    fn timer(&self) -> Result<&Timer, Error> {
        self.timer
            .get_or_init(|| Timer::start().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::Spawn(std::io::Error::other(e.clone())))
    }
}

/// One request's deadline: set when it passes, waking the request.
struct Deadline {
    passed: AtomicBool,
    waker: WakerSlot,
}

/// Deadlines in time order, kept by one thread.
struct Timer {
    shared: Arc<TimerShared>,
}

struct TimerShared {
    state: Mutex<TimerState>,
    changed: Condvar,
}

struct TimerState {
    /// (when, id); an id no longer in `armed` was disarmed. Such entries are
    /// not searched for when disarmed (that would cost O(n) each): they are
    /// popped when due, or cleared out by [`TimerState::disarm`].
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    armed: FxHashMap<u64, Arc<Deadline>>,
    next_id: u64,
    stop: bool,
}

/// Disarmed entries the heap may hold beyond as many as are armed before it
/// is cleared out: a few requests in flight never pay for a rebuild.
const SLACK: usize = 64;

impl TimerState {
    /// Disarms `id`; returns its deadline, to be dropped after the lock.
    fn disarm(&mut self, id: u64) -> Option<Arc<Deadline>> {
        let removed = self.armed.remove(&id);
        self.prune();
        removed
    }

    /// A disarmed entry would otherwise stay in the heap until its deadline,
    /// so with long timeouts answered requests would pile up there. Once
    /// the disarmed entries outnumber the armed ones (plus [`SLACK`]), the
    /// heap is rebuilt with only the armed ones. A rebuild costs O(heap),
    /// which is O(the disarmed entries it removes), and each disarm leaves
    /// one such entry: O(1) amortized per request. Called after every
    /// disarm and expiry, it keeps the heap within `2 * armed + SLACK`.
    fn prune(&mut self) {
        if self.heap.len() > 2 * self.armed.len() + SLACK {
            let armed = &self.armed;
            self.heap.retain(|Reverse((_, id))| armed.contains_key(id));
        }
    }
}

impl Timer {
    fn start() -> std::io::Result<Self> {
        let shared = Arc::new(TimerShared {
            state: Mutex::new(TimerState {
                heap: BinaryHeap::new(),
                armed: FxHashMap::default(),
                next_id: 0,
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let keeper = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("blazesub-deadlines".into())
            .spawn(move || keeper.run())?;
        Ok(Self { shared })
    }

    /// Arms a deadline `timeout` from now; disarmed when the guard drops.
    fn arm(&self, timeout: Duration) -> Armed<'_> {
        let deadline = Arc::new(Deadline {
            passed: AtomicBool::new(false),
            waker: WakerSlot::new(),
        });
        let at = Instant::now().checked_add(timeout);
        let mut state = self.shared.lock();
        let id = state.next_id;
        state.next_id += 1;
        if let Some(at) = at {
            let earliest = state.heap.peek().map(|Reverse((when, _))| *when);
            state.heap.push(Reverse((at, id)));
            state.armed.insert(id, Arc::clone(&deadline));
            if earliest.is_none_or(|earliest| at < earliest) {
                self.shared.changed.notify_one();
            }
        }
        Armed {
            timer: self,
            id,
            deadline,
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_one();
    }
}

impl TimerShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, TimerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(&self) {
        let mut state = self.lock();
        let mut due = Vec::new();
        loop {
            if state.stop {
                return;
            }
            let now = Instant::now();
            while let Some(&Reverse((when, id))) = state.heap.peek() {
                if when > now {
                    break;
                }
                state.heap.pop();
                if let Some(deadline) = state.armed.remove(&id) {
                    due.push(deadline);
                }
            }
            state.prune();
            let next = state.heap.peek().map(|Reverse((when, _))| *when);
            if !due.is_empty() {
                drop(state);
                for deadline in due.drain(..) {
                    deadline.passed.store(true, Ordering::Release);
                    deadline.waker.wake();
                }
                state = self.lock();
                continue;
            }
            state = match next {
                Some(when) => {
                    let wait = when.saturating_duration_since(now);
                    self.changed
                        .wait_timeout(state, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

/// An armed deadline; dropping it disarms it.
struct Armed<'a> {
    timer: &'a Timer,
    id: u64,
    deadline: Arc<Deadline>,
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        // The deadline is dropped after the lock is released.
        let removed = self.timer.shared.lock().disarm(self.id);
        drop(removed);
    }
}

impl<T: Send + Sync + 'static> Bus<T> {
    /// Publishes `data` to `topic` as a request and waits for the first
    /// reply, at most `timeout`.
    ///
    /// A responder answers with [`Bus::reply`]. Errors:
    /// [`Error::NoResponders`] at once if no subscription matched,
    /// [`Error::Timeout`] at the deadline, [`Error::Closed`] if the bus is
    /// (or gets) closed first, [`Error::InvalidArgument`] for a topic under
    /// `$reply/` (where replies go), and those of [`Bus::publish`].
    ///
    /// Cancel-safe: dropping the future ends the request (its reply
    /// subscription is removed; a reply that comes later is counted in
    /// [`Stats::late_replies`](crate::Stats::late_replies)).
    ///
    /// From a handler, prefer an async handler ([`Bus::subscribe_async`]),
    /// which awaits the reply without holding a thread. A sync handler may
    /// block on a request where it may block (a `WorkerPool` worker, not a
    /// tokio worker). A request a sync handler makes on a pool worker runs
    /// its deliveries there, on the requester's stack, before it waits:
    /// responders that reply from their handlers have answered by then,
    /// however many workers are blocked in requests, and a responder that
    /// takes long holds the request past its `timeout`. An async handler's
    /// request queues its job and keeps its deadline, unless the job would
    /// queue behind that very worker (a pool of one, or the topic's home is
    /// this worker): then it runs in the handler's first poll, the same way.
    /// A request to another bus queues on that bus.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::{Bus, Error};
    /// use std::time::Duration;
    ///
    /// let bus = Bus::<f64>::builder().build()?;
    /// let responder = bus.clone();
    /// let _service = bus.subscribe("rpc/price/+", move |m| {
    ///     let eur = *m.data() * 0.92;
    ///     responder.reply(m, eur).unwrap();
    /// })?;
    ///
    /// let answer = bus.request("rpc/price/eur", 100.0, Duration::from_secs(1)).await?;
    /// assert_eq!(*answer.data(), 92.0);
    ///
    /// // Nobody answers this: an error at once, not after the timeout.
    /// let nobody = bus.request("rpc/weather", 0.0, Duration::from_secs(60)).await;
    /// assert!(matches!(nobody, Err(Error::NoResponders { .. })));
    /// # Ok(()) }
    /// ```
    pub async fn request(
        &self,
        topic: &str,
        data: T,
        timeout: Duration,
    ) -> Result<Arc<Message<T>>, Error> {
        let mut replies = self.await_replies(topic, data, timeout, 1).await?;
        replies.pop().ok_or_else(|| Error::Timeout {
            topic: topic.to_owned(),
            waited: timeout,
        })
    }

    /// Publishes `data` to `topic` as a request and collects up to `max`
    /// replies, waiting at most `timeout`: returns as soon as `max` have
    /// come, or at the deadline with those that came (at least one).
    ///
    /// `topic` may also be a filter (`health/+`): the request then reaches
    /// every subscription whose filter shares a topic with it (`health/db`,
    /// `health/#`, `+/db`), a scatter-gather; its messages' topic is the
    /// filter. ([`Bus::request`] accepts a filter the same way.)
    ///
    /// A `max` of `usize::MAX` takes as many replies as come by the
    /// deadline. Replies wait for the request in a mailbox of at most 4,096
    /// (whatever `max` is, so a large one allocates no more room); the
    /// request takes them as they come, so only a burst of more than 4,096
    /// at once that outruns it (more `Inline` responders than that, which
    /// all answer inside the publish) loses the newest of them (the first
    /// replies are kept), counted in [`Stats::dropped`](crate::Stats::dropped).
    ///
    /// Errors: as [`Bus::request`] ([`Error::Timeout`] when not one reply
    /// came), and [`Error::InvalidArgument`] for a `max` of 0.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::Bus;
    /// use std::time::Duration;
    ///
    /// let bus = Bus::<String>::builder().build()?;
    /// let mut services = Vec::new();
    /// for name in ["billing", "orders", "search"] {
    ///     let responder = bus.clone();
    ///     services.push(bus.subscribe(&format!("health/{name}"), move |m| {
    ///         responder.reply(m, format!("{name}: ok")).unwrap();
    ///     })?);
    /// }
    ///
    /// let answers = bus.request_many("health/+", "ping".into(), Duration::from_millis(200), 10).await?;
    /// assert_eq!(answers.len(), 3); // all there were, at the deadline
    /// # Ok(()) }
    /// ```
    pub async fn request_many(
        &self,
        topic: &str,
        data: T,
        timeout: Duration,
        max: usize,
    ) -> Result<Vec<Arc<Message<T>>>, Error> {
        if max == 0 {
            return Err(Error::InvalidArgument {
                name: "max",
                value: max.to_string(),
                reason: "must be at least 1",
            });
        }
        self.await_replies(topic, data, timeout, max).await
    }

    /// Answers `request` with `data`: publishes it to the request's reply
    /// topic. Returns how many subscriptions it reached: 1 while the request
    /// waits, 0 once it has ended (the reply is then dropped and counted in
    /// [`Stats::late_replies`](crate::Stats::late_replies)).
    ///
    /// Errors: [`Error::NotARequest`] if `request` has no reply topic, and
    /// those of [`Bus::publish`] but [`Error::RecursionLimit`]: a reply
    /// made by a handler 64 nested publishes deep still reaches its
    /// requester (it goes to a reply topic, and nests no further).
    pub fn reply(&self, request: &Message<T>, data: T) -> Result<usize, Error> {
        let Some(to) = request.reply_to() else {
            return Err(Error::NotARequest {
                topic: request.topic().to_owned(),
            });
        };
        // Not refused at the depth limit: a reply goes to a reply topic,
        // whose handlers' own publishes are checked, so it nests one level
        // at most, and the requester one level up gets its answer instead of
        // waiting out its timeout.
        let matched = self
            .publish_nested(to, data, None, None, false)
            .map_err(|rejected| rejected.error)?;
        if matched == 0 {
            self.inner
                .env
                .counters
                .late_replies
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(matched)
    }

    /// Subscribes the reply stream and publishes the request. The receiver
    /// is the request's reply subscription: dropping it ends the request.
    fn send_request(&self, topic: &str, data: T, max: usize) -> Result<Receiver<T>, Error> {
        let to_filter = match validate_topic(topic) {
            Ok(()) => false,
            Err(error) => {
                // Not a topic name: a filter (not shared) is a scatter-gather.
                if validate_filter(topic).is_err() || split_shared(topic).is_some() {
                    return Err(error.into());
                }
                true
            }
        };
        if topic.split('/').next() == Some(REPLY_ROOT) {
            // It would reach the requests' own reply streams, its own first.
            return Err(Error::InvalidArgument {
                name: "topic",
                value: topic.to_owned(),
                reason: "is under $reply/, where replies go; a request cannot be sent there",
            });
        }
        self.check_open()?;
        self.check_depth(topic)?;
        let inner = &*self.inner;
        let reply_to: Arc<str> = Arc::from(inner.requests.reply_topic());
        let replies = self.insert_stream(
            &reply_to,
            self.next_id(),
            max.min(MAX_QUEUED_REPLIES),
            // The first replies are kept: one over `max` is dropped and
            // counted, not one that came earlier.
            StreamOverflow::DropNewest,
            false,
        )?;
        let admitted = inner.env.counters.begin_publish()?;
        let route = if to_filter {
            Arc::new(Route::uncached(&inner.trie, topic))
        } else {
            inner.routes.route(&inner.trie, topic)
        };
        let message = self
            .stamp(Arc::clone(&route.topic), data, None)
            .with_reply_to(reply_to);
        let in_place = inner.dispatcher.runs_request_here(route.home.place());
        let publish = || self.fan_out(admitted, topic, route, Arc::new(message), None);
        // A sync handler's request on a pool worker (which it blocks until
        // the reply comes), or an async handler's whose job would queue
        // behind that very worker: the job runs here (see `Bus::request`).
        let matched = if in_place {
            publish_in_place(&inner.env, publish)
        } else {
            publish()
        }
        .map_err(|rejected| rejected.error)?;
        if matched == 0 {
            return Err(Error::NoResponders {
                topic: topic.to_owned(),
            });
        }
        Ok(replies)
    }

    async fn await_replies(
        &self,
        topic: &str,
        data: T,
        timeout: Duration,
        max: usize,
    ) -> Result<Vec<Arc<Message<T>>>, Error> {
        let timer = self.inner.requests.timer()?;
        // No reply can come once `close` is called (`reply` is refused): a
        // waiting request ends with `Error::Closed` then, not once the bus
        // has drained.
        let mut closing = std::pin::pin!(self.inner.closing.wait());
        let mut replies = self.send_request(topic, data, max)?;
        let armed = timer.arm(timeout);
        let mut got = Vec::new();
        let outcome = std::future::poll_fn(|cx| {
            loop {
                match replies.poll_recv(cx) {
                    Poll::Ready(Some(reply)) => {
                        got.push(reply);
                        if got.len() >= max {
                            return Poll::Ready(Ok(()));
                        }
                    }
                    Poll::Ready(None) => return Poll::Ready(Err(Error::Closed)),
                    Poll::Pending => break,
                }
            }
            if std::future::Future::poll(closing.as_mut(), cx).is_ready() {
                return Poll::Ready(Err(Error::Closed));
            }
            armed.deadline.waker.register(cx.waker());
            if armed.deadline.passed.load(Ordering::Acquire) {
                return Poll::Ready(Err(Error::Timeout {
                    topic: topic.to_owned(),
                    waited: timeout,
                }));
            }
            Poll::Pending
        })
        .await;
        drop(armed);
        drop(replies);
        match outcome {
            Ok(()) => Ok(got),
            Err(_) if !got.is_empty() => Ok(got),
            Err(error) => Err(error),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// (heap entries, armed deadlines).
    fn sizes(timer: &Timer) -> (usize, usize) {
        let state = timer.shared.lock();
        (state.heap.len(), state.armed.len())
    }

    /// Answered requests with long timeouts: nothing comes due, so only
    /// disarming can clear their entries out.
    #[test]
    fn disarmed_deadlines_do_not_accumulate_in_the_heap() {
        let timer = Timer::start().unwrap();
        let hour = Duration::from_secs(3600);
        let waiting: Vec<_> = (0..100).map(|_| timer.arm(hour)).collect();
        for _ in 0..100_000 {
            drop(timer.arm(hour));
            let (heap, armed) = sizes(&timer);
            assert_eq!(armed, 100);
            assert!(
                heap <= 2 * armed + SLACK,
                "{heap} heap entries for {armed} armed"
            );
        }
        drop(waiting);
        let (heap, armed) = sizes(&timer);
        assert_eq!(armed, 0);
        assert!(heap <= SLACK, "{heap} heap entries for none armed");
    }

    /// Rebuilding the heap keeps the armed deadlines: they still pass.
    #[test]
    fn armed_deadlines_pass_across_rebuilds() {
        let timer = Timer::start().unwrap();
        let soon: Vec<_> = (0..10)
            .map(|_| timer.arm(Duration::from_millis(20)))
            .collect();
        for _ in 0..10_000 {
            drop(timer.arm(Duration::from_secs(3600)));
        }
        let start = Instant::now();
        while !soon
            .iter()
            .all(|armed| armed.deadline.passed.load(Ordering::Acquire))
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "a deadline never passed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let (heap, armed) = sizes(&timer);
        assert_eq!(armed, 0);
        assert!(heap <= SLACK, "{heap} heap entries for none armed");
    }
}
