//! [`BridgeBuilder`]: which engine, which topics, which codec.

use std::sync::Arc;
use std::time::Duration;

use super::codec::{Codec, Json};
use super::Bridge;
use crate::bus::Bus;
use crate::error::Error;
use crate::topic::validate_filter;
use crate::StreamOptions;

/// The engine a bridge joins.
#[derive(Clone, Debug)]
pub(crate) enum Engine {
    /// NATS server URL(s).
    #[cfg(feature = "nats")]
    Nats(String),
    /// An MQTT 5 broker URL.
    #[cfg(feature = "mqtt")]
    Mqtt(String),
}

/// Builds a [`Bridge`]; made by [`Bridge::builder`].
///
/// ```no_run
/// # #[cfg(feature = "nats")]
/// # async fn run() -> Result<(), blazesub::Error> {
/// use blazesub::bridge::Bridge;
/// use blazesub::Bus;
///
/// let bus = Bus::<bytes::Bytes>::builder().build()?;
/// let bridge = Bridge::builder(&bus)
///     .nats("nats://127.0.0.1:4222")
///     .export("orders/#")
///     .import("orders/#")
///     .start()
///     .await?;
/// bridge.close().await?;
/// # Ok(()) }
/// ```
#[must_use = "a builder does nothing until .start().await"]
pub struct BridgeBuilder<T> {
    pub(crate) bus: Bus<T>,
    pub(crate) engine: Option<Engine>,
    pub(crate) exports: Vec<String>,
    pub(crate) imports: Vec<String>,
    pub(crate) codec: Arc<dyn Codec<T>>,
    pub(crate) name: Option<String>,
    pub(crate) export_buffer: usize,
    pub(crate) outgoing_buffer: usize,
    pub(crate) import_buffer: usize,
    pub(crate) backoff: (Duration, Duration),
    /// `Some(session expiry)`: MQTT QoS 1 (see [`Self::at_least_once`]).
    pub(crate) at_least_once: Option<Duration>,
}

impl<T> Clone for BridgeBuilder<T> {
    fn clone(&self) -> Self {
        Self {
            bus: self.bus.clone(),
            engine: self.engine.clone(),
            exports: self.exports.clone(),
            imports: self.imports.clone(),
            codec: Arc::clone(&self.codec),
            name: self.name.clone(),
            export_buffer: self.export_buffer,
            outgoing_buffer: self.outgoing_buffer,
            import_buffer: self.import_buffer,
            backoff: self.backoff,
            at_least_once: self.at_least_once,
        }
    }
}

impl<T> std::fmt::Debug for BridgeBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeBuilder")
            .field("engine", &self.engine)
            .field("exports", &self.exports)
            .field("imports", &self.imports)
            .field("name", &self.name)
            .field("export_buffer", &self.export_buffer)
            .field("outgoing_buffer", &self.outgoing_buffer)
            .field("import_buffer", &self.import_buffer)
            .field("backoff", &self.backoff)
            .field("at_least_once", &self.at_least_once)
            .finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> BridgeBuilder<T> {
    pub(crate) fn new(bus: &Bus<T>) -> Self
    where
        Json: Codec<T>,
    {
        Self::with_codec(bus, Arc::new(Json))
    }

    pub(crate) fn with_codec(bus: &Bus<T>, codec: Arc<dyn Codec<T>>) -> Self {
        Self {
            bus: bus.clone(),
            engine: None,
            exports: Vec::new(),
            imports: Vec::new(),
            codec,
            name: None,
            export_buffer: 8_192,
            outgoing_buffer: 8_192,
            import_buffer: 65_536,
            backoff: (Duration::from_millis(50), Duration::from_secs(5)),
            at_least_once: None,
        }
    }

    /// The NATS server(s) to join: a URL, or several separated by commas
    /// (members of one cluster; the client also learns the others from the
    /// server). A bridge joins one engine: this replaces an engine set
    /// earlier (`mqtt`). Feature `nats`.
    #[cfg(feature = "nats")]
    pub fn nats(mut self, url: impl Into<String>) -> Self {
        self.engine = Some(Engine::Nats(url.into()));
        self
    }

    /// The MQTT 5 broker to join: `mqtt://host:port` (port 1883 if left
    /// out). A bridge joins one engine: this replaces an engine set earlier
    /// (`nats`). Feature `mqtt`.
    #[cfg(feature = "mqtt")]
    pub fn mqtt(mut self, url: impl Into<String>) -> Self {
        self.engine = Some(Engine::Mqtt(url.into()));
        self
    }

    /// Local publishes matching `filter` go out (call once per filter).
    pub fn export(mut self, filter: impl Into<String>) -> Self {
        self.exports.push(filter.into());
        self
    }

    /// Remote publishes matching `filter` come in, to local subscribers
    /// whose filters overlap it (call once per filter).
    pub fn import(mut self, filter: impl Into<String>) -> Self {
        self.imports.push(filter.into());
        self
    }

    /// The payload codec (default: [`Json`], which passes `Bytes` through).
    pub fn codec(mut self, codec: impl Codec<T>) -> Self {
        self.codec = Arc::new(codec);
        self
    }

    /// The connection's name, as the server's monitoring shows it (NATS),
    /// or the client id (MQTT; unique per broker). Default: `blazesub-`
    /// and the node's random id.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Messages each export filter holds while the bridge sends (default
    /// 8,192, at most [`StreamOptions::MAX_CAPACITY`]); beyond it the oldest
    /// is dropped and counted.
    pub fn export_buffer(mut self, messages: usize) -> Self {
        self.export_buffer = messages;
        self
    }

    /// Messages held while disconnected (default 8,192); beyond it the
    /// oldest is dropped and counted.
    pub fn outgoing_buffer(mut self, messages: usize) -> Self {
        self.outgoing_buffer = messages;
        self
    }

    /// Messages queued per local filter while its subscribers are busy
    /// (default 65,536, at most [`StreamOptions::MAX_CAPACITY`]); beyond it a
    /// message is dropped and counted as a slow consumer.
    pub fn import_buffer(mut self, messages: usize) -> Self {
        self.import_buffer = messages;
        self
    }

    /// The reconnect delay: doubling from `min` up to `max`, each jittered
    /// down by up to half (default 50 ms to 5 s). `start` refuses a zero
    /// `min` or a `min` over `max`.
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = (min, max);
        self
    }

    /// MQTT only: **at least once** (QoS 1) instead of at most once (QoS 0,
    /// the default). Feature `mqtt`.
    ///
    /// - **Exports** go out with QoS 1 and count as `sent` only when the
    ///   broker acknowledges them (a refusal in its PUBACK counts as
    ///   `dropped`). What a lost connection left unacknowledged or unwritten
    ///   is sent again once the bridge is back, so a message may reach the
    ///   broker twice; and, sent again, it may come after messages
    ///   published later. What the bridge still had not sent when it closes
    ///   (it waits up to 2 s for acknowledgements) counts as `dropped`.
    /// - **Imports** are subscribed with QoS 1 in a session the broker
    ///   keeps for `session_expiry` after a disconnect: what was published
    ///   meanwhile (as much as the broker queues) arrives on reconnecting.
    ///   A message is acknowledged as the bridge takes it in; a full import
    ///   queue still drops it, counted as a slow consumer.
    /// - The session is this bridge's: it starts one at its first
    ///   connection, even if an earlier bridge of the same [`Self::name`]
    ///   left one (whose subscriptions this bridge would not know), and
    ///   resumes it at every reconnect.
    ///
    /// - A broker whose Maximum QoS is 0 (its ConnAck says so) gets QoS 0
    ///   exports, logged: it would close the connection at each QoS 1
    ///   publish.
    ///
    /// A `session_expiry` of zero keeps no session across a disconnect:
    /// exports are still sent again, but what is published for the imports
    /// while the connection is down is lost (uncounted: the broker drops it).
    /// `session_expiry` is sent in whole seconds (rounded up), at most
    /// `u32::MAX - 1` of them (longer is taken as that; MQTT's `u32::MAX`
    /// would mean never). With NATS, `start` refuses it: core NATS is at
    /// most once.
    #[cfg(feature = "mqtt")]
    pub fn at_least_once(mut self, session_expiry: Duration) -> Self {
        self.at_least_once = Some(session_expiry);
        self
    }

    /// Connects (retrying in the background if the server is not up yet)
    /// and starts the bridge. Needs a tokio runtime.
    ///
    /// Errors: [`Error::Topic`] for an invalid filter,
    /// [`Error::InvalidArgument`] without an engine, with no filter at
    /// all, a zero buffer, an export or import buffer over
    /// [`StreamOptions::MAX_CAPACITY`], a reconnect backoff with a zero or
    /// inverted range, or `at_least_once` with NATS,
    /// [`Error::NoRuntime`] outside a runtime,
    /// [`Error::Closed`] if the bus is closed, and [`Error::Bridge`] if the
    /// client refuses the URL.
    ///
    /// With MQTT it returns once the client is set up, connected or not;
    /// with NATS the client connects in the background, so `start` returns
    /// before the connection is up: poll [`Bridge::stats`]`().connected`
    /// if you need to know (exports published meanwhile wait in the
    /// outgoing buffer). Cancel-safe: dropped before it returns, it has
    /// started no task and watches nothing on the bus (the client it made
    /// is dropped with it).
    pub async fn start(self) -> Result<Bridge, Error> {
        for filter in self.exports.iter().chain(&self.imports) {
            validate_filter(filter)?;
            if crate::topic::split_shared(filter).is_some() {
                return Err(Error::InvalidArgument {
                    name: "filter",
                    value: filter.clone(),
                    reason: "is a shared subscription; a bridge exports and imports plain filters",
                });
            }
        }
        if self.exports.is_empty() && self.imports.is_empty() {
            return Err(Error::InvalidArgument {
                name: "export/import",
                value: "none".into(),
                reason: "must name at least one filter",
            });
        }
        for (name, value) in [
            ("export_buffer", self.export_buffer),
            ("outgoing_buffer", self.outgoing_buffer),
            ("import_buffer", self.import_buffer),
        ] {
            if value == 0 {
                return Err(Error::InvalidArgument {
                    name,
                    value: "0".into(),
                    reason: "must be at least 1",
                });
            }
        }
        // Allocated whole (an export tap is a stream's mailbox; an import
        // queue a channel with that many permits).
        for (name, value) in [
            ("export_buffer", self.export_buffer),
            ("import_buffer", self.import_buffer),
        ] {
            if value > StreamOptions::MAX_CAPACITY {
                return Err(Error::InvalidArgument {
                    name,
                    value: value.to_string(),
                    reason: "must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
                });
            }
        }
        let (min, max) = self.backoff;
        if min.is_zero() || min > max {
            return Err(Error::InvalidArgument {
                name: "reconnect_backoff",
                value: format!("{min:?}..{max:?}"),
                reason: "needs 0 < min <= max (a zero delay reconnects in a tight loop)",
            });
        }
        Bridge::start(self).await
    }
}
