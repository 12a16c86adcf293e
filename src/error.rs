//! The crate's one error type.

use std::time::Duration;

use crate::topic::TopicError;

/// Everything that can go wrong in blazesub. Each variant says what was wrong
/// and with which input.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A topic name or filter breaks MQTT's rules; the [`TopicError`] names the
    /// input and the rule.
    #[error(transparent)]
    Topic(#[from] TopicError),

    /// The bus has been closed: it accepts no more publishes or subscriptions.
    #[error("the bus is closed: it accepts no more publishes or subscriptions")]
    Closed,

    /// [`Bus::close`](crate::Bus::close) gave up waiting for accepted
    /// deliveries. The bus stays closed; the remaining deliveries still finish.
    #[error(
        "closing the bus timed out after {waited:?} with {inflight} deliveries still in flight; \
         the bus stays closed and they still finish, unless a handler never returns \
         (Stats::inflight counts them)"
    )]
    CloseTimeout {
        /// How long `close` waited.
        waited: Duration,
        /// Deliveries still unfinished when it gave up.
        inflight: u64,
    },

    /// Something needs a tokio runtime and the bus has none: a
    /// `TaskPerSubscriber` bus, or an async handler subscription.
    #[error("{what} needs a tokio runtime: build the bus inside one, or give it one with BusBuilder::runtime")]
    NoRuntime {
        /// What needed the runtime.
        what: &'static str,
    },

    /// A configuration value is out of range.
    #[error("invalid configuration: `{field}` = {value} {reason}")]
    InvalidConfig {
        /// The field, as named in [`Config`](crate::Config).
        field: &'static str,
        /// The value given.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },

    /// An argument passed to a call is out of range (for a value that comes
    /// from [`Config`](crate::Config), see [`Error::InvalidConfig`]).
    #[error("invalid argument: `{name}` = {value} {reason}")]
    InvalidArgument {
        /// The parameter, as named in the call's signature.
        name: &'static str,
        /// The value given.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },

    /// Under [`Overflow::Error`](crate::Overflow::Error), the queue or task cap
    /// was full: some deliveries of this publish were dropped (and counted in
    /// [`Stats::dropped`](crate::Stats::dropped)). The rest were delivered
    /// (streams, lossless ones included, and the handlers that fit): the
    /// publish was accepted, so retrying it delivers it again to those.
    #[error("publishing to {topic:?} overloaded the bus: {dropped} of {matched} deliveries were dropped")]
    Overloaded {
        /// The topic published to.
        topic: String,
        /// Deliveries that were dropped.
        dropped: usize,
        /// Subscriptions the publish matched.
        matched: usize,
    },

    /// `publish` found a lossless ([`StreamOverflow::Backpressure`](crate::StreamOverflow::Backpressure))
    /// mailbox among its targets full, and so reached no subscriber at all.
    /// Retry later, or use [`Bus::publish_async`](crate::Bus::publish_async),
    /// which waits for room.
    #[error("publishing to {topic:?} reached no one: a lossless stream subscription's mailbox ({capacity} messages) is full; retry, or use publish_async to wait for room")]
    Full {
        /// The topic published to.
        topic: String,
        /// The full mailbox's capacity.
        capacity: usize,
    },

    /// Handlers publishing from inside handlers, each publish run on its
    /// publisher's thread, nested deeper than the limit (a handler whose
    /// publish reaches itself again): in `Inline` mode, or in the others
    /// where a full queue or task cap has the publisher run its publish
    /// itself. This publish was refused, reached no one, and was counted in
    /// [`Stats::recursion_refused`](crate::Stats::recursion_refused).
    #[error("publishing to {topic:?} was refused: publishes run in place nested {depth} deep (a handler publishing to a topic that reaches itself?)")]
    RecursionLimit {
        /// The topic published to.
        topic: String,
        /// How deep the publishes were nested.
        depth: usize,
    },

    /// A request ([`Bus::request`](crate::Bus::request)) matched no
    /// subscription, so nobody could answer it. Returned at once, not at the
    /// deadline.
    #[error("no subscription matches {topic:?}: nobody can answer this request")]
    NoResponders {
        /// The topic the request was published to.
        topic: String,
    },

    /// A request got no reply before its deadline.
    #[error("no reply to the request on {topic:?} within {waited:?}")]
    Timeout {
        /// The topic the request was published to.
        topic: String,
        /// The timeout the request was given.
        waited: Duration,
    },

    /// [`Bus::reply`](crate::Bus::reply) was given a message that is not a
    /// request (it has no reply topic).
    #[error("the message on {topic:?} is not a request: it has no reply topic")]
    NotARequest {
        /// The topic of the message replied to.
        topic: String,
    },

    /// The operating system refused to start a worker thread.
    #[error("could not start a worker thread: {0}")]
    Spawn(#[source] std::io::Error),

    /// A bridge (features `nats`, `mqtt`) could not start: the engine's
    /// client refused its settings (a URL it cannot parse, for one).
    #[error("the bridge to {engine} at {url:?} failed: {reason}")]
    Bridge {
        /// The engine: `"NATS"` or `"MQTT"`.
        engine: &'static str,
        /// The URL given to the bridge.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

/// A publish the bus refused, from [`Bus::try_publish`](crate::Bus::try_publish):
/// why, and the value back when it never entered the bus.
#[derive(Debug)]
#[non_exhaustive]
pub struct Rejected<T> {
    /// Why the publish failed.
    pub error: Error,
    /// The value published, handed back: `Some` when the bus refused it
    /// outright ([`Error::Closed`], [`Error::Topic`], [`Error::Full`],
    /// [`Error::RecursionLimit`]); `None` when it was
    /// accepted and some deliveries were then dropped
    /// ([`Error::Overloaded`]), since it reached other subscribers.
    pub value: Option<T>,
}

impl<T> Rejected<T> {
    pub(crate) fn with_value(error: Error, value: T) -> Self {
        Self {
            error,
            value: Some(value),
        }
    }

    /// The value, if it was handed back.
    pub fn into_value(self) -> Option<T> {
        self.value
    }
}

impl<T> std::fmt::Display for Rejected<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T: std::fmt::Debug> std::error::Error for Rejected<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<Rejected<T>> for Error {
    fn from(rejected: Rejected<T>) -> Self {
        rejected.error
    }
}
