//! Stream subscriptions: [`Receiver`] and the [`Mailbox`] behind it.
//!
//! # Contract
//! - A mailbox is **bounded** (`Config::stream_capacity`, default 1,024).
//!   When it is full, the *oldest* message is dropped to make room, counted in
//!   [`Receiver::lost`] and in `Stats::dropped`. A publisher never waits for a
//!   reader, and a reader that falls behind still sees the newest messages.
//! - Messages from **one publisher arrive in publish order**. Pushing into a
//!   mailbox runs no user code and never blocks, so every delivery mode
//!   performs it on the publisher's own thread, before `publish` returns;
//!   nothing can reorder two pushes made one after the other.
//! - [`Receiver::recv`] returns `None` once the bus has been closed (or
//!   dropped) and the mailbox is empty. Dropping the receiver unsubscribes.
//! - A message counts as delivered (`Stats::delivered`) when the receiver takes
//!   it; one still waiting in the mailbox is neither delivered nor lost yet,
//!   and one still there when the receiver is dropped counts as dropped.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::message::Message;
use crate::stats::Counters;
use crate::subscriber::Subscriber;
use crate::subscription::Subscription;
use crate::sync::queue::ArrayQueue;
use crate::sync::{AtomicBool, AtomicU64, Ordering, WakerSlot};

/// What became of one push.
pub(crate) enum Pushed {
    /// Queued.
    Queued,
    /// Queued, and the oldest message was dropped to make room.
    DisplacedOldest,
    /// Refused: the mailbox is closed.
    Closed,
}

/// A stream subscription's bounded, drop-oldest queue.
pub(crate) struct Mailbox<T> {
    queue: ArrayQueue<Arc<Message<T>>>,
    waker: WakerSlot,
    lost: AtomicU64,
    closed: AtomicBool,
}

impl<T> Mailbox<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queue: ArrayQueue::new(capacity),
            waker: WakerSlot::new(),
            lost: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        }
    }

    pub(crate) fn push(&self, message: Arc<Message<T>>) -> Pushed {
        if self.closed.load(Ordering::Acquire) {
            self.lost.fetch_add(1, Ordering::Relaxed);
            return Pushed::Closed;
        }
        let pushed = match self.queue.force_push(message) {
            None => Pushed::Queued,
            Some(_oldest) => {
                self.lost.fetch_add(1, Ordering::Relaxed);
                Pushed::DisplacedOldest
            }
        };
        self.waker.wake();
        pushed
    }

    /// Messages this mailbox dropped.
    pub(crate) fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.waker.wake();
    }

    pub(crate) fn poll_pop(&self, cx: &mut Context<'_>) -> Poll<Option<Arc<Message<T>>>> {
        if let Some(message) = self.queue.pop() {
            return Poll::Ready(Some(message));
        }
        self.waker.register(cx.waker());
        // Re-check after registering: a push or close in between would
        // otherwise wake nobody.
        if let Some(message) = self.queue.pop() {
            return Poll::Ready(Some(message));
        }
        if self.closed.load(Ordering::Acquire) {
            // A push that raced the close may have landed after our pop.
            return Poll::Ready(self.queue.pop());
        }
        Poll::Pending
    }
}

/// Why [`Receiver::try_recv`] returned no message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvError {
    /// Nothing is waiting; more may come.
    #[error("no message is waiting")]
    Empty,
    /// Nothing is waiting and nothing will come: the bus is closed or gone.
    #[error("the bus is closed and this receiver has taken every message")]
    Closed,
}

/// A stream subscription: an ordered, bounded mailbox of messages.
///
/// Get one from [`Bus::subscribe_stream`](crate::Bus::subscribe_stream). It
/// also implements [`futures_core::Stream`]. Dropping it unsubscribes.
///
/// ```
/// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
/// use blazesub::Bus;
///
/// let bus = Bus::<String>::builder().build()?;
/// let mut orders = bus.subscribe_stream("orders/#")?;
/// bus.publish("orders/eu/1", "first".to_string())?;
/// bus.publish("orders/us/2", "second".to_string())?;
///
/// assert_eq!(orders.recv().await.unwrap().data(), "first");
/// assert_eq!(orders.recv().await.unwrap().data(), "second");
/// assert_eq!(orders.lost(), 0);
/// # Ok(()) }
/// ```
pub struct Receiver<T> {
    entry: Arc<Subscriber<T, Mailbox<T>>>,
    counters: Arc<Counters>,
    subscription: Subscription,
}

impl<T> Receiver<T> {
    pub(crate) fn new(
        entry: Arc<Subscriber<T, Mailbox<T>>>,
        counters: Arc<Counters>,
        subscription: Subscription,
    ) -> Self {
        Self {
            entry,
            counters,
            subscription,
        }
    }

    fn taken(&self, message: Option<Arc<Message<T>>>) -> Option<Arc<Message<T>>> {
        if message.is_some() {
            self.counters.received_from_stream();
        }
        message
    }

    /// The next message, waiting if none is queued; `None` once the bus is
    /// closed (or dropped) and everything queued has been taken.
    ///
    /// Cancel-safe: if the future is dropped before it completes, no message
    /// is lost.
    pub async fn recv(&mut self) -> Option<Arc<Message<T>>> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Polls for the next message (the building block of [`Self::recv`] and the
    /// `Stream` implementation).
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Arc<Message<T>>>> {
        self.entry
            .sink
            .poll_pop(cx)
            .map(|message| self.taken(message))
    }

    /// The next message if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Result<Arc<Message<T>>, TryRecvError> {
        let mailbox = &self.entry.sink;
        if let Some(message) = mailbox.queue.pop() {
            return Ok(self.taken(Some(message)).expect("just popped"));
        }
        if mailbox.closed.load(Ordering::Acquire) {
            return match mailbox.queue.pop() {
                Some(message) => Ok(self.taken(Some(message)).expect("just popped")),
                None => Err(TryRecvError::Closed),
            };
        }
        Err(TryRecvError::Empty)
    }

    /// Messages this subscription lost because its mailbox was full (the
    /// oldest made room for the newest), or arrived after it was closed.
    pub fn lost(&self) -> u64 {
        self.entry.sink.lost()
    }

    /// Messages waiting in the mailbox.
    pub fn len(&self) -> usize {
        self.entry.sink.queue.len()
    }

    /// Whether no message is waiting.
    pub fn is_empty(&self) -> bool {
        self.entry.sink.queue.is_empty()
    }

    /// How many messages the mailbox holds before it drops the oldest.
    pub fn capacity(&self) -> usize {
        self.entry.sink.queue.capacity()
    }

    /// The subscription's id, unique within its bus.
    pub fn id(&self) -> u64 {
        self.subscription.id()
    }

    /// The filter this receiver subscribed with.
    pub fn filter(&self) -> &str {
        self.subscription.filter()
    }
}

/// Unsubscribes, and counts the messages left unread as dropped.
impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.subscription.remove_now();
        let mailbox = &self.entry.sink;
        // Closing first makes a push that races this drop count itself.
        mailbox.close();
        let mut unread = 0;
        while mailbox.queue.pop().is_some() {
            unread += 1;
        }
        if unread > 0 {
            self.counters.dropped_now(unread);
        }
    }
}

impl<T> futures_core::Stream for Receiver<T> {
    type Item = Arc<Message<T>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_recv(cx)
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("id", &self.id())
            .field("filter", &self.filter())
            .field("queued", &self.len())
            .field("lost", &self.lost())
            .finish()
    }
}
