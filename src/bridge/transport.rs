//! The small internal trait every engine sits behind: publish a message,
//! hold an upstream subscription for one filter, say whether connected.
//!
//! Topics cross it in MQTT form; mapping them to the engine's syntax, and
//! carrying metadata and the origin node id, is the transport's job
//! (`nats.rs`). Reconnecting is the transport's job too, and so is
//! restoring its upstream subscriptions afterwards.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

use crate::message::Metadata;

/// A boxed future, as the trait's methods return.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A message going out: a local publish to export.
pub(crate) struct Outgoing {
    pub(crate) topic: Arc<str>,
    pub(crate) payload: Bytes,
    pub(crate) metadata: Option<Metadata>,
}

/// A message that came in on an upstream subscription.
pub(crate) struct Incoming {
    /// The topic name, in MQTT form; `None` if the engine's subject is not
    /// one this bridge's mapping makes (another client published it).
    pub(crate) topic: Option<String>,
    /// The subject as the engine gave it, for logs.
    pub(crate) raw_subject: String,
    pub(crate) payload: Bytes,
    pub(crate) metadata: Option<Metadata>,
    /// The node id of the bridge that sent it, if a bridge did.
    pub(crate) origin: Option<String>,
}

/// A message as an upstream subscription hands it to the bridge: decoded
/// already (MQTT), or as the client gave it (NATS), to be decoded by the
/// import's delivery task: the reader that moves a NATS message out of the
/// client's channel must do as little as it can (see `nats.rs`).
pub(crate) enum Arrival {
    Decoded(Incoming),
    #[cfg(feature = "nats")]
    Nats(async_nats::Message),
}

impl Arrival {
    pub(crate) fn decode(self) -> Incoming {
        match self {
            Arrival::Decoded(incoming) => incoming,
            #[cfg(feature = "nats")]
            Arrival::Nats(message) => super::nats::incoming(message),
        }
    }
}

impl From<Incoming> for Arrival {
    fn from(incoming: Incoming) -> Self {
        Arrival::Decoded(incoming)
    }
}

/// Called for every message an upstream subscription receives. It never
/// waits: it queues the message for local delivery or counts it dropped.
pub(crate) type Deliver = Arc<dyn Fn(Arrival) + Send + Sync>;

/// Why a publish did not go out.
pub(crate) enum SendError {
    /// The connection is down (or went down): buffer and retry.
    Disconnected,
    /// The message cannot ever go out (too big, bad subject): drop it.
    Refused(String),
}

/// One upstream subscription; dropping it unsubscribes (what the client
/// still holds for it is dropped: its local filter has no subscriber left).
pub(crate) trait Upstream: Send {
    /// Unsubscribes at the bridge's close, starting when called; the future
    /// it returns hands `deliver` everything the client took in for this
    /// subscription until it stopped taking more (the bridge is closing,
    /// so `deliver` counts each dropped), and ends then. By default, as
    /// dropping: for a client that holds nothing of its own (MQTT, whose
    /// event loop calls `deliver` itself).
    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        drop(self);
        Box::pin(std::future::ready(()))
    }
}

/// An engine connection.
pub(crate) trait Transport: Send + Sync + 'static {
    /// Sends one message; may wait for room in the client's own queue,
    /// never for the network round trip.
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), SendError>>;
    /// Subscribes upstream to `filter` (a valid MQTT filter); `deliver` is
    /// called for each message until the returned handle is dropped.
    fn subscribe<'a>(
        &'a self,
        filter: &'a str,
        deliver: Deliver,
    ) -> BoxFuture<'a, Result<Box<dyn Upstream>, String>>;
    /// Whether the transport counts `sent` itself (when the client writes
    /// the message, and `dropped` for what it loses before that), rather
    /// than the exporter when `publish` returns `Ok`.
    fn counts_sent(&self) -> bool {
        false
    }
    /// Whether the connection is up now.
    fn connected(&self) -> bool;
    /// Sends what the client has queued, then closes the connection.
    fn close(&self) -> BoxFuture<'_, ()>;
}
