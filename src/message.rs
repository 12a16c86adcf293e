//! What a subscriber receives: [`Message`] and its optional [`Metadata`].
//!
//! A publish wraps its value in one `Arc<Message<T>>`, shared by every
//! subscriber it reaches; the value is never cloned per subscriber. Handlers
//! see it as `&Message<T>`, async handlers and stream receivers as
//! `Arc<Message<T>>`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

/// One published value, with the topic it was published to.
///
/// ```
/// use blazesub::{Message, Metadata};
///
/// let m = Message::new("orders/eu/42", 3u32)
///     .with_metadata(Metadata::new().with("trace-id", "7f3a"));
/// assert_eq!(m.topic(), "orders/eu/42");
/// assert_eq!(*m.data(), 3);
/// assert_eq!(m.metadata().and_then(|md| md.get("trace-id")), Some("7f3a"));
/// ```
#[derive(Debug)]
pub struct Message<T> {
    topic: Arc<str>,
    payload: Payload<T>,
    metadata: Option<Metadata>,
    timestamp: SystemTime,
    /// The retained store's sequence number of a `publish_retained`, 0 for
    /// every other message (see `retained.rs`).
    seq: u64,
    /// Delivered from the retained store (a snapshot), not live.
    retained: bool,
    /// Where a reply goes, on a request (see `request.rs`).
    reply_to: Option<Arc<str>>,
    /// Came in through a bridge: its export taps skip it (no loops).
    imported: bool,
    /// The `Inline` depth its publish runs its handlers at (0: not an
    /// `Inline` publish). An ordered handler's runner that runs it later
    /// (it was published from inside one of that runner's own calls) runs
    /// it at least this deep, so a handler that publishes to itself meets
    /// the depth limit as a plain one does.
    inline_depth: u8,
}

/// The value a message carries: its own, or (for a retained message handed
/// to a new subscription) that of the message it was retained from, shared.
#[derive(Debug)]
enum Payload<T> {
    Value(T),
    Retained(Arc<Message<T>>),
}

impl<T> Message<T> {
    /// A message stamped with the current time. The bus builds its own; this is
    /// for testing handlers directly.
    pub fn new(topic: impl Into<Arc<str>>, data: T) -> Self {
        Self::stamped(topic.into(), data, None)
    }

    /// Attaches metadata (replacing any already attached).
    pub fn with_metadata(mut self, metadata: Metadata) -> Self {
        self.metadata = Some(metadata);
        self
    }

    pub(crate) fn stamped(topic: Arc<str>, data: T, metadata: Option<Metadata>) -> Self {
        Self {
            topic,
            payload: Payload::Value(data),
            metadata,
            timestamp: SystemTime::now(),
            seq: 0,
            retained: false,
            reply_to: None,
            imported: false,
            inline_depth: 0,
        }
    }

    /// Records the `Inline` depth its handlers run at.
    pub(crate) fn at_inline_depth(mut self, depth: usize) -> Self {
        self.inline_depth = u8::try_from(depth).unwrap_or(u8::MAX);
        self
    }

    /// The `Inline` depth its publish runs its handlers at (0: none).
    #[inline]
    pub(crate) fn inline_depth(&self) -> usize {
        usize::from(self.inline_depth)
    }

    /// Marks a message as having come in through a bridge.
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn imported(mut self) -> Self {
        self.imported = true;
        self
    }

    /// Whether the message came in through a bridge (so a bridge must not
    /// send it out again).
    #[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
    pub(crate) fn is_imported(&self) -> bool {
        self.origin().imported
    }

    /// Marks a message as the retained store's number `seq`.
    pub(crate) fn with_seq(mut self, seq: u64) -> Self {
        self.seq = seq;
        self
    }

    /// Gives a request its reply topic.
    pub(crate) fn with_reply_to(mut self, reply_to: Arc<str>) -> Self {
        self.reply_to = Some(reply_to);
        self
    }

    /// The retained store's sequence number (0 unless `publish_retained`).
    #[inline]
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The copy of a retained message handed to a new subscription: it
    /// shares `origin`'s value and says [`Self::is_retained`].
    pub(crate) fn retained_copy(origin: &Arc<Message<T>>) -> Self {
        Self {
            topic: Arc::clone(&origin.topic),
            payload: Payload::Retained(Arc::clone(origin)),
            metadata: None,
            timestamp: origin.timestamp,
            seq: 0,
            retained: true,
            reply_to: None,
            imported: false,
            inline_depth: 0,
        }
    }

    /// The message whose value and metadata this one carries.
    fn origin(&self) -> &Self {
        match &self.payload {
            Payload::Value(_) => self,
            Payload::Retained(origin) => origin,
        }
    }

    /// The topic name the message was published to (for a request published
    /// to a filter, see [`Bus::request_many`](crate::Bus::request_many),
    /// that filter).
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The published value.
    pub fn data(&self) -> &T {
        match &self.payload {
            Payload::Value(data) => data,
            Payload::Retained(origin) => origin.data(),
        }
    }

    /// The metadata given to `publish_with`, if any.
    pub fn metadata(&self) -> Option<&Metadata> {
        self.origin().metadata.as_ref()
    }

    /// Whether this message was delivered because it was retained: it is
    /// the topic's retained message, handed to a subscription made after it
    /// was published (see [`Bus::publish_retained`](crate::Bus::publish_retained)).
    /// A retained publish delivered live, to subscriptions that already
    /// existed, says `false`, as MQTT 5's default "retain as published" off.
    pub fn is_retained(&self) -> bool {
        self.retained
    }

    /// The topic a reply to this message goes to, when it is a request
    /// ([`Bus::request`](crate::Bus::request)); answer it with
    /// [`Bus::reply`](crate::Bus::reply).
    pub fn reply_to(&self) -> Option<&str> {
        self.origin().reply_to.as_deref()
    }

    /// When `publish` was called (wall-clock time).
    pub fn timestamp(&self) -> SystemTime {
        self.timestamp
    }
}

/// String key/value pairs that travel with a message: trace ids, content types,
/// the origin of a bridged message.
///
/// Keys are kept sorted, so iteration order is stable.
///
/// ```
/// use blazesub::Metadata;
///
/// let md: Metadata = [("content-type", "json"), ("origin", "node-2")].into_iter().collect();
/// assert_eq!(md.len(), 2);
/// assert_eq!(md.get("origin"), Some("node-2"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Metadata(BTreeMap<String, String>);

impl Metadata {
    /// Empty metadata.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a pair, builder style.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.insert(key, value);
        self
    }

    /// Adds or replaces a pair, returning the value it replaced.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) -> Option<String> {
        self.0.insert(key.into(), value.into())
    }

    /// The value for `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// How many pairs there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Metadata {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}
