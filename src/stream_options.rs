//! [`StreamOptions`]: a stream subscription's mailbox size and what happens
//! when it is full ([`StreamOverflow`]), chosen per subscription.

use serde::{Deserialize, Serialize};

/// What a stream subscription's mailbox does when a message arrives and it
/// is full. Every policy counts what it loses, in [`Receiver::lost`](crate::Receiver::lost)
/// and [`Stats::dropped`](crate::Stats::dropped), and shows it in the stream
/// ([`RecvError`](crate::RecvError)).
///
/// A retained snapshot larger than the mailbox
/// ([`Bus::publish_retained`](crate::Bus::publish_retained)) meets the same
/// policy as a burst of publishes would, with one exception: `DropOldest`
/// keeps its newest messages, `DropNewest` its oldest, `Disconnect` is
/// disconnected by the first that does not fit; `Backpressure` has no
/// publisher to hold back at subscribe time, so it keeps the newest and
/// counts the rest as lost, like `DropOldest`.
///
/// In a configuration file it is spelled as `Config`'s enums are
/// (`"drop_oldest"`, `"drop_newest"`, `"backpressure"`, `"disconnect"`);
/// the variant names are accepted too.
///
/// ```
/// use blazesub::StreamOverflow;
///
/// let policy: StreamOverflow = serde_json::from_str(r#""drop_newest""#).unwrap();
/// assert_eq!(policy, StreamOverflow::DropNewest);
/// let same: StreamOverflow = serde_json::from_str(r#""DropNewest""#).unwrap();
/// assert_eq!(same, policy);
/// assert_eq!(serde_json::to_string(&policy).unwrap(), r#""drop_newest""#);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamOverflow {
    /// The oldest queued message makes room for the new one (the default):
    /// a reader that falls behind sees the newest messages, and
    /// `recv_lagged` reports `Lagged(n)` before the first one after the gap.
    #[default]
    #[serde(alias = "DropOldest")]
    DropOldest,
    /// The new message is dropped; the queued ones stay. `recv_lagged`
    /// reports `Lagged(n)` at its next call: the lost messages were newer
    /// than those still queued, so the report comes before the gap, not at
    /// it.
    #[serde(alias = "DropNewest")]
    DropNewest,
    /// Lossless: publishers are held back instead (a retained snapshot that
    /// does not fit is the exception: see above). `publish` returns
    /// [`Error::Full`](crate::Error::Full) and reaches no subscriber at all
    /// while this mailbox is full; `publish_async` waits for room in every
    /// such mailbox it reaches, then delivers to all. A full lossless
    /// mailbox therefore holds back every publisher of the topics it
    /// subscribes to, and only those (a publisher waiting for it holds no
    /// room meanwhile in a mailbox that had some): the price of losing
    /// nothing. `close` ends
    /// every such wait with `Error::Closed`.
    #[serde(alias = "Backpressure")]
    Backpressure,
    /// NATS's slow-consumer rule: the first message that does not fit
    /// closes the mailbox (that message is counted as lost, and reported by
    /// `recv_lagged` as `Lagged(1)` at its next call; `Lagged(2)` or more if
    /// several publishers overflowed it at the same moment). The reader takes every
    /// message it held, then learns why the stream ended: `recv_lagged`
    /// returns [`RecvError::Disconnected`](crate::RecvError::Disconnected)
    /// (`recv` returns `None`). Publishes skip a disconnected mailbox from
    /// then on; drop the receiver to unsubscribe it.
    #[serde(alias = "Disconnect")]
    Disconnect,
}

/// A stream subscription's options, for
/// [`Bus::subscribe_stream_with`](crate::Bus::subscribe_stream_with).
///
/// ```
/// use blazesub::{StreamOptions, StreamOverflow};
///
/// let options = StreamOptions::new(4_096).overflow(StreamOverflow::Backpressure);
/// assert_eq!(options.capacity(), 4_096);
/// assert_eq!(options.overflow_policy(), StreamOverflow::Backpressure);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamOptions {
    capacity: usize,
    overflow: StreamOverflow,
}

impl StreamOptions {
    /// The largest mailbox a stream subscription may have: 16,777,216
    /// (2^24) messages. A mailbox's slots are allocated when it is
    /// subscribed, 16 bytes each, so this one takes 256 MiB before any
    /// message comes: seconds of backlog at millions of messages a second,
    /// more than a reader that keeps up needs, and not so much that a
    /// process cannot have it. A larger capacity is refused with
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) rather than
    /// attempted: `usize::MAX` (meant as "unbounded", which no mailbox is)
    /// would panic, and `1 << 40` would abort the process when the
    /// allocation fails. The same bound applies to
    /// [`Config::stream_capacity`](crate::Config::stream_capacity).
    pub const MAX_CAPACITY: usize = 1 << 24;

    /// A mailbox of `capacity` messages that drops the oldest when full.
    /// (A capacity of 0, or above [`Self::MAX_CAPACITY`], is refused when
    /// subscribing.)
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            overflow: StreamOverflow::DropOldest,
        }
    }

    /// Sets what happens when the mailbox is full.
    #[must_use]
    pub fn overflow(mut self, overflow: StreamOverflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// Messages the mailbox holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// What happens when it is full.
    pub fn overflow_policy(&self) -> StreamOverflow {
        self.overflow
    }
}
