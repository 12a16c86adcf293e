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
    data: T,
    metadata: Option<Metadata>,
    timestamp: SystemTime,
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
            data,
            metadata,
            timestamp: SystemTime::now(),
        }
    }

    /// The topic name the message was published to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The published value.
    pub fn data(&self) -> &T {
        &self.data
    }

    /// The metadata given to `publish_with`, if any.
    pub fn metadata(&self) -> Option<&Metadata> {
        self.metadata.as_ref()
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
