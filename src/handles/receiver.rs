//! Stream subscriptions: the [`Receiver`] handle.
//!
//! # Contract
//! - A mailbox is **bounded** (`Config::stream_capacity`, default 1,024, or
//!   the capacity in [`StreamOptions`](crate::StreamOptions)). What a full
//!   one does is its [`StreamOverflow`](crate::StreamOverflow) policy. By
//!   default (`DropOldest`) the *oldest* message is dropped to make room,
//!   counted in [`Receiver::lost`] and in `Stats::dropped`: a publisher never
//!   waits for a reader, and a reader that falls behind still sees the
//!   newest messages. `DropNewest` drops the new message instead,
//!   `Disconnect` ends the stream, and `Backpressure` loses nothing and holds
//!   publishers back instead.
//! - **Loss can be seen in the stream itself**, as with tokio's broadcast
//!   channel: [`Receiver::recv_lagged`] (and [`Receiver::try_recv_lagged`])
//!   returns [`RecvError::Lagged(n)`](RecvError::Lagged) once, `n` being the
//!   messages this receiver lost since it last reported a lag. Drop-oldest
//!   always drops the oldest queued messages, so the gap sits just before
//!   the head of the mailbox and the report comes before the first message
//!   after it; under the other policies it comes at the next call (see
//!   `StreamOverflow`).
//!   [`Receiver::recv`], [`Receiver::try_recv`] and the `Stream`
//!   implementation report no lag and read on across a gap
//!   (`while let Some(m) = rx.recv().await` works as ever); `lost()` counts
//!   either way.
//! - Messages from **one publisher arrive in publish order**. Pushing into a
//!   mailbox runs no user code and never blocks, so every delivery mode
//!   performs it on the publisher's own thread, before `publish` returns;
//!   nothing can reorder two pushes made one after the other.
//! - [`Receiver::recv`] returns `None` once the bus has been closed (or
//!   dropped) and the mailbox is empty (the lagged calls return
//!   [`RecvError::Closed`]); from then on the receiver is terminated, as
//!   [`FusedStream`](futures_core::FusedStream) reports, and the lagged
//!   calls return the end every time: a loss counted after it (a publish
//!   refused by the closed mailbox) is in `lost()` and `Stats::dropped`, not
//!   reported in the ended stream. Dropping the receiver unsubscribes.
//! - A message counts as delivered (`Stats::delivered`) when the receiver takes
//!   it; one still waiting in the mailbox is neither delivered nor lost yet,
//!   and one still there when the receiver is dropped counts as dropped,
//!   including one a publisher pushes while the receiver is being dropped.
//!
//!
//! The mailbox behind a receiver, and how a push racing the receiver's drop
//! is still counted, are described in `registry/mailbox.rs`.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::subscription::Subscription;
use crate::message::Message;
use crate::registry::entry::StreamEntry;
use crate::registry::mailbox::Popped;
use crate::stats::Counters;

/// Why [`Receiver::try_recv`] returned no message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvError {
    /// Nothing is waiting; more may come.
    #[error("no message is waiting")]
    Empty,
    /// Nothing is waiting and nothing will come: the bus is closed or gone,
    /// or a `Disconnect` mailbox overflowed ([`Receiver::try_recv_lagged`]
    /// tells the two apart).
    #[error(
        "nothing more will come: the bus is closed, or this stream was disconnected (try_recv_lagged tells which)"
    )]
    Closed,
}

/// Why [`Receiver::recv_lagged`] returned no message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecvError {
    /// This receiver lost `n` messages since it last reported a lag (or since
    /// it subscribed): pushed out of its full mailbox by newer ones, or
    /// arriving after it was closed. Reported once, before the next message
    /// that follows the gap; with drop-oldest the lost ones were the oldest
    /// queued, so the gap precedes the current head of the mailbox. Reading
    /// on is fine: the next call returns that message.
    ///
    /// `n` is exact. Where the report falls is exact unless a publisher is
    /// pushing out a message at the very moment this receiver takes the one
    /// after it: then the report can come a message or so later than the
    /// gap, never earlier.
    #[error("this receiver fell behind: {0} messages were lost before the next one")]
    Lagged(u64),
    /// Nothing is waiting and nothing will come: the bus is closed or gone,
    /// and this receiver has taken every message and heard of every loss.
    #[error("the bus is closed and this receiver has taken every message")]
    Closed,
    /// The stream was cut because a message did not fit in its full mailbox
    /// ([`StreamOverflow::Disconnect`](crate::StreamOverflow::Disconnect)).
    /// The receiver has taken every message it held; the one that did not
    /// fit was reported as `Lagged` first.
    #[error("the stream was disconnected: its mailbox was full and a message did not fit")]
    Disconnected,
}

/// Why [`Receiver::try_recv_lagged`] returned no message: [`RecvError`], or
/// nothing waiting yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvLaggedError {
    /// Nothing is waiting and no loss to report; more may come.
    #[error("no message is waiting")]
    Empty,
    /// As [`RecvError::Lagged`]: `n` messages were lost before the next one.
    #[error("this receiver fell behind: {0} messages were lost before the next one")]
    Lagged(u64),
    /// As [`RecvError::Closed`].
    #[error("the bus is closed and this receiver has taken every message")]
    Closed,
    /// As [`RecvError::Disconnected`].
    #[error("the stream was disconnected: its mailbox was full and a message did not fit")]
    Disconnected,
}

impl From<RecvError> for TryRecvLaggedError {
    fn from(error: RecvError) -> Self {
        match error {
            RecvError::Lagged(n) => Self::Lagged(n),
            RecvError::Closed => Self::Closed,
            RecvError::Disconnected => Self::Disconnected,
        }
    }
}

/// A stream subscription: an ordered, bounded mailbox of messages.
///
/// Get one from [`Bus::subscribe_stream`](crate::Bus::subscribe_stream). It
/// also implements [`futures_core::Stream`] and
/// [`futures_core::FusedStream`]. Dropping it unsubscribes.
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
#[must_use = "dropping a Receiver unsubscribes it at once"]
pub struct Receiver<T> {
    entry: StreamEntry<T>,
    counters: Arc<Counters>,
    subscription: Subscription,
    /// The mailbox's `lost` as of the last `Lagged` this receiver returned.
    lost_reported: u64,
    /// This receiver has reported the end (`None` or `Closed`).
    terminated: bool,
}

impl<T> Receiver<T> {
    pub(crate) fn new(
        entry: StreamEntry<T>,
        counters: Arc<Counters>,
        subscription: Subscription,
    ) -> Self {
        Self {
            entry,
            counters,
            subscription,
            lost_reported: 0,
            terminated: false,
        }
    }

    /// Counts a message this receiver took as delivered.
    fn took(&self, message: Arc<Message<T>>) -> Arc<Message<T>> {
        self.counters.received_from_stream();
        message
    }

    /// Messages lost since the last lag this receiver reported, if any, now
    /// counted as reported.
    fn take_lag(&mut self) -> Option<u64> {
        let lost = self.entry.sink.lost();
        if lost <= self.lost_reported {
            return None;
        }
        let lag = lost - self.lost_reported;
        self.lost_reported = lost;
        Some(lag)
    }

    /// The mailbox is closed and empty: a last lag if there is one, else the
    /// end.
    /// Why the stream ended: cut by its overflow policy, or closed.
    fn end_reason(&self) -> RecvError {
        if self.entry.sink.disconnected() {
            RecvError::Disconnected
        } else {
            RecvError::Closed
        }
    }

    fn ended(&mut self) -> RecvError {
        match self.take_lag() {
            Some(lag) => RecvError::Lagged(lag),
            None => {
                self.terminated = true;
                self.end_reason()
            }
        }
    }

    /// The next message, waiting if none is queued; `None` once the bus is
    /// closed (or dropped) and everything queued has been taken.
    ///
    /// Reads on across a gap left by lost messages without saying so (see
    /// [`Self::recv_lagged`] for a reader that wants to know).
    ///
    /// Cancel-safe: if the future is dropped before it completes, no message
    /// is lost.
    pub async fn recv(&mut self) -> Option<Arc<Message<T>>> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Polls for the next message (the building block of [`Self::recv`] and the
    /// `Stream` implementation). Once it has returned `Ready(None)` it keeps
    /// doing so.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Arc<Message<T>>>> {
        if self.terminated {
            return Poll::Ready(None);
        }
        match self.entry.sink.poll_pop(cx) {
            Poll::Ready(Some(message)) => Poll::Ready(Some(self.took(message))),
            Poll::Ready(None) => {
                self.terminated = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Room a lossless mailbox has for new reservations (model checks).
    #[cfg(all(test, loom))]
    pub(crate) fn unreserved_room(&self) -> Option<usize> {
        self.entry.sink.unreserved_room()
    }

    /// Closes a bridge's export tap: pushes from now on are refused (and
    /// counted in `lost`), and what is queued can still be read.
    #[cfg(any(feature = "nats", feature = "mqtt"))]
    pub(crate) fn close_tap(&self) {
        self.entry.sink.close();
    }

    /// The next message if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Result<Arc<Message<T>>, TryRecvError> {
        if self.terminated {
            return Err(TryRecvError::Closed);
        }
        match self.entry.sink.try_pop() {
            Ok(message) => Ok(self.took(message)),
            Err(Popped::Closed) => {
                self.terminated = true;
                Err(TryRecvError::Closed)
            }
            Err(Popped::Empty) => Err(TryRecvError::Empty),
        }
    }

    /// The next message, waiting if none is queued, or word of a gap:
    /// [`RecvError::Lagged(n)`](RecvError::Lagged) when `n` messages were
    /// lost since this receiver last reported a lag (reported once, just
    /// before the first message after the gap), and [`RecvError::Closed`]
    /// once the bus is closed (or dropped) and everything queued has been
    /// taken. After a `Lagged`, call it again for the message.
    ///
    /// Cancel-safe: if the future is dropped before it completes, no message
    /// and no lag report is lost.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::{Bus, RecvError};
    ///
    /// let bus = Bus::<u32>::builder().build()?;
    /// let mut ticks = bus.subscribe_stream_with_capacity("ticks", 2)?;
    /// for tick in 0..5 {
    ///     bus.publish("ticks", tick)?; // 5 into a mailbox of 2
    /// }
    /// bus.close().await?;
    ///
    /// let mut seen = Vec::new();
    /// loop {
    ///     match ticks.recv_lagged().await {
    ///         Ok(m) => seen.push(format!("tick {}", m.data())),
    ///         Err(RecvError::Lagged(n)) => seen.push(format!("lost {n}")),
    ///         Err(RecvError::Closed | RecvError::Disconnected) => break,
    ///     }
    /// }
    /// assert_eq!(seen, ["lost 3", "tick 3", "tick 4"]);
    /// # Ok(()) }
    /// ```
    pub async fn recv_lagged(&mut self) -> Result<Arc<Message<T>>, RecvError> {
        std::future::poll_fn(|cx| self.poll_recv_lagged(cx)).await
    }

    /// Polls for the next message or lag report (the building block of
    /// [`Self::recv_lagged`]).
    pub fn poll_recv_lagged(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Arc<Message<T>>, RecvError>> {
        // The end is final: a loss counted after it (a publish refused by
        // the closed mailbox, which passed its check just before the close)
        // is in `lost` and the bus's stats, not reported in a stream that
        // has ended.
        if self.terminated {
            return Poll::Ready(Err(self.end_reason()));
        }
        if let Some(lag) = self.take_lag() {
            return Poll::Ready(Err(RecvError::Lagged(lag)));
        }
        match self.entry.sink.poll_pop(cx) {
            Poll::Ready(Some(message)) => Poll::Ready(Ok(self.took(message))),
            Poll::Ready(None) => Poll::Ready(Err(self.ended())),
            Poll::Pending => Poll::Pending,
        }
    }

    /// [`Self::recv_lagged`] without waiting:
    /// [`TryRecvLaggedError::Empty`] when nothing is queued and no loss is
    /// left to report.
    ///
    /// ```
    /// use blazesub::{Bus, DeliveryMode, TryRecvLaggedError};
    ///
    /// let bus = Bus::<u32>::builder().delivery(DeliveryMode::Inline).build()?;
    /// let mut rx = bus.subscribe_stream_with_capacity("n", 1)?;
    /// assert_eq!(rx.try_recv_lagged().unwrap_err(), TryRecvLaggedError::Empty);
    /// bus.publish("n", 1)?;
    /// bus.publish("n", 2)?;
    /// assert_eq!(rx.try_recv_lagged().unwrap_err(), TryRecvLaggedError::Lagged(1));
    /// assert_eq!(*rx.try_recv_lagged().unwrap().data(), 2);
    /// # Ok::<(), blazesub::Error>(())
    /// ```
    pub fn try_recv_lagged(&mut self) -> Result<Arc<Message<T>>, TryRecvLaggedError> {
        // The end is final (see `poll_recv_lagged`).
        if self.terminated {
            return Err(self.end_reason().into());
        }
        if let Some(lag) = self.take_lag() {
            return Err(TryRecvLaggedError::Lagged(lag));
        }
        match self.entry.sink.try_pop() {
            Ok(message) => Ok(self.took(message)),
            Err(Popped::Empty) => Err(TryRecvLaggedError::Empty),
            Err(Popped::Closed) => Err(self.ended().into()),
        }
    }

    /// Messages this subscription lost because its mailbox was full (which
    /// ones is its [`StreamOverflow`](crate::StreamOverflow) policy's: by
    /// default the oldest made room for the newest), or arrived after it was
    /// closed.
    /// A running total: reading it reports no lag.
    pub fn lost(&self) -> u64 {
        self.entry.sink.lost()
    }

    /// Messages waiting in the mailbox.
    pub fn len(&self) -> usize {
        self.entry.sink.len()
    }

    /// Whether no message is waiting.
    pub fn is_empty(&self) -> bool {
        self.entry.sink.is_empty()
    }

    /// How many messages the mailbox holds before its overflow policy
    /// applies.
    pub fn capacity(&self) -> usize {
        self.entry.sink.capacity()
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

/// Unsubscribes, and counts the messages left unread as dropped (with any a
/// publisher pushes meanwhile: see the module docs).
impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.subscription.remove_now();
        if self.entry.sink.is_lossless() {
            self.counters.lossless_removed();
        }
        let unread = self.entry.sink.reader_dropped();
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

/// Terminated once the stream has returned `None` (or the receiver has
/// otherwise reported the end: `try_recv` or the lagged calls returned
/// `Closed`); polling it afterwards keeps returning `None`.
impl<T> futures_core::FusedStream for Receiver<T> {
    fn is_terminated(&self) -> bool {
        self.terminated
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("id", &self.id())
            .field("filter", &self.filter())
            .field("queued", &self.len())
            .field("lost", &self.lost())
            .field("terminated", &self.terminated)
            .finish()
    }
}
