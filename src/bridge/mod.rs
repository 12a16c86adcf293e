//! The bridge: join buses on many machines through a NATS server (feature
//! `nats`) or an MQTT 5 broker (feature `mqtt`).
//!
//! Each process's bus joins an existing engine; blazesub builds no cluster
//! of its own. A [`Bridge`] sends local publishes that match its *export*
//! filters to the engine, and delivers the engine's messages that match its
//! *import* filters to local subscribers. Both engines sit behind one small
//! internal transport trait; everything below holds for both, except where
//! it names one.
//!
//! ```no_run
//! # #[cfg(not(feature = "nats"))] fn main() {}
//! # #[cfg(feature = "nats")]
//! # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
//! use blazesub::bridge::{Bridge, BridgeStats};
//! use blazesub::Bus;
//!
//! let bus = Bus::<bytes::Bytes>::builder().build()?;
//! let bridge = Bridge::builder(&bus)
//!     .nats("nats://127.0.0.1:4222")
//!     .export("orders/#") // local publishes matching these go out
//!     .import("orders/#") // remote publishes matching these come in
//!     .start()
//!     .await?;
//! let _sub = bus.subscribe("orders/+", |m| println!("{}", m.topic()))?;
//! bus.publish("orders/42", bytes::Bytes::from_static(b"{}"))?;
//! let stats: BridgeStats = bridge.stats();
//! # let _ = stats;
//! bridge.close().await?;
//! # Ok(()) }
//! ```
//!
//! # Contract
//! - **Subscription sharing.** A node holds one upstream subscription per
//!   distinct local filter that overlaps an import (on the overlap), made
//!   when the filter's first local subscriber appears and removed when its
//!   last leaves, however many local subscribers share it. The engine sends
//!   the node one copy; the bus fans it out. The bus tells the bridge of
//!   these changes off the publish path, and the bridge reconciles its
//!   table with the engine in a task of its own, so a storm of subscribes
//!   and unsubscribes on one filter coalesces instead of flapping
//!   (`import.rs`).
//! - **Exactly one local delivery per remote message and matching
//!   subscription**, even when upstream subscriptions overlap (`a/#` and
//!   `a/+` each get their own copy from the engine): each copy goes only to
//!   the subscribers of the filter whose upstream subscription it came on.
//! - **No loops, no echoes.** A message that came in is marked and never
//!   exported again; a node's own exports are not delivered back to it
//!   (NATS `no_echo` / MQTT 5 No Local, and an origin header or user
//!   property with the node's id, checked on every incoming message, for
//!   brokers that ignore No Local). Its local subscribers had them once
//!   already. The id is the bus's, shared by all its bridges: a bus with
//!   one bridge that exports and another that imports the same topics
//!   does not get its own exports back either.
//! - **MQTT specifics** (`mqtt.rs`): topics go as they are; two local
//!   filters that need the same upstream filter share one MQTT subscription
//!   (MQTT keys subscriptions by filter); every subscription carries a
//!   subscription identifier, which routes each incoming copy to exactly
//!   its local filters; the session starts clean (unless `at_least_once`)
//!   and the bridge subscribes again from its own table on every ConnAck, after a jittered backoff
//!   that paces rumqttc's reconnects.
//! - **At most once** by default, as core NATS; over MQTT, **at least
//!   once** with [`BridgeBuilder::at_least_once`] (QoS 1 in a session the
//!   broker keeps: what a broken connection left unacknowledged is sent
//!   again, and what was published while it was down arrives after it).
//!   Order is kept per publisher and topic
//!   (one topic always leaves through one export tap, in publish order, on
//!   one connection). Every loss the bridge can see is counted in
//!   [`BridgeStats::dropped`]; what the client had written to a socket the
//!   instant the connection broke is lost without being seen, and so is
//!   what the engine had sent and the client had not read when `close`
//!   unsubscribed.
//! - **Never blocks a local publisher.** Exports go through a bounded tap
//!   (dropping its oldest when the bridge lags, counted), and a bounded
//!   outgoing buffer while disconnected (`export.rs`).
//! - **Faults.** The client reconnects forever with a jittered exponential
//!   delay and restores the subscriptions the bridge holds (exactly its
//!   table); a server that is not up when the bridge starts is retried the
//!   same way. Slow-consumer drops and payloads that fail to decode are
//!   counted (and logged with the topic), never a panic.
//! - **Topics map invertibly** to subjects ([`mapping`]); metadata travels
//!   as NATS headers. Payloads go through a [`Codec`]: `Bus<bytes::Bytes>`
//!   untouched, any serde type as JSON by default.
//!
//! What the bridge does not carry: retained messages (a new subscriber on
//! another node does not get them), shared subscriptions (`$share/...`
//! subscribers are not interest and receive no remote messages; NATS queue
//! groups would be their equivalent), and requests/replies across nodes.
//!
//! Files: `builder.rs` (the builder), `stats.rs` ([`BridgeStats`]),
//! `transport.rs` (the internal engine trait), `nats.rs` and `mqtt.rs`
//! (the engines behind it), `backoff.rs` (reconnect pacing, node ids),
//! `mapping.rs` (topics ↔ subjects), `codec.rs` (payloads), `import.rs`
//! (interest table, reconciler, delivery), `export.rs` (taps and sending).

mod backoff;
mod builder;
mod codec;
mod export;
mod import;
pub mod mapping;
#[cfg(feature = "mqtt")]
mod mqtt;
#[cfg(feature = "nats")]
mod nats;
mod stats;
mod transport;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

pub use builder::BridgeBuilder;
pub use codec::{Codec, CodecError, Json};
pub use stats::BridgeStats;

use crate::bus::Bus;
use crate::error::Error;
use crate::registry::trie::Interest;
use export::Exporter;
use import::{Importer, Table};
use stats::Counters;
use transport::Transport;

/// A running bridge between a bus and an engine. Closing it (or dropping
/// it) stops both directions; the bus carries on locally.
#[must_use = "dropping a Bridge stops it; keep it, and call .close().await to stop it"]
pub struct Bridge {
    stats: Arc<Counters>,
    transport: Arc<dyn Transport>,
    running: Mutex<Option<Running>>,
    /// The runtime the bridge started on: `close` runs there.
    runtime: tokio::runtime::Handle,
    /// `close` has begun: the bridge no longer counts as connected.
    closed: AtomicBool,
}

struct Running {
    tasks: Vec<JoinHandle<()>>,
    stops: Vec<Arc<Notify>>,
    unwatch: Box<dyn FnOnce() + Send>,
}

impl Running {
    fn stop(self) -> Vec<JoinHandle<()>> {
        (self.unwatch)();
        for stop in &self.stops {
            stop.notify_one();
        }
        self.tasks
    }
}

impl Bridge {
    /// A builder for a bridge of `bus`, with the default codec ([`Json`]:
    /// `bytes::Bytes` untouched, any serde type as JSON).
    pub fn builder<T: Send + Sync + 'static>(bus: &Bus<T>) -> BridgeBuilder<T>
    where
        Json: Codec<T>,
    {
        BridgeBuilder::new(bus)
    }

    /// A builder for a bridge of `bus` whose values need their own codec
    /// (they are not serde types, or should travel in another format).
    pub fn builder_with_codec<T: Send + Sync + 'static>(
        bus: &Bus<T>,
        codec: impl Codec<T>,
    ) -> BridgeBuilder<T> {
        BridgeBuilder::with_codec(bus, Arc::new(codec))
    }

    async fn start<T: Send + Sync + 'static>(builder: BridgeBuilder<T>) -> Result<Self, Error> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(Error::NoRuntime { what: "a bridge" });
        };
        let Some(engine) = builder.engine.clone() else {
            return Err(Error::InvalidArgument {
                name: "nats/mqtt",
                value: "none".into(),
                reason: "must be given: the bridge needs an engine URL",
            });
        };
        builder.bus.check_open()?;
        let stats = Arc::new(Counters::default());
        let wake = Arc::new(Notify::new());
        let origin = builder
            .bus
            .inner
            .node_id
            .get_or_init(backoff::node_id)
            .clone();
        // The connection's own name: two bridges of one bus share the
        // origin, but an MQTT broker lets one connection per client id.
        let connection = backoff::node_id();
        let backoff = backoff::Backoff {
            min: builder.backoff.0,
            max: builder.backoff.1,
        };
        let transport: Arc<dyn Transport> = match engine {
            #[cfg(feature = "nats")]
            builder::Engine::Nats(url) => {
                if builder.at_least_once.is_some() {
                    return Err(Error::InvalidArgument {
                        name: "at_least_once",
                        value: url,
                        reason: "needs MQTT: core NATS delivers at most once",
                    });
                }
                let settings = nats::Settings {
                    url: url.clone(),
                    name: builder
                        .name
                        .clone()
                        .unwrap_or_else(|| format!("blazesub-{connection}")),
                    origin: origin.clone(),
                    backoff,
                };
                Arc::new(
                    nats::Nats::connect(settings, Arc::clone(&stats), Arc::clone(&wake))
                        .await
                        .map_err(|reason| Error::Bridge {
                            engine: "NATS",
                            url,
                            reason,
                        })?,
                )
            }
            #[cfg(feature = "mqtt")]
            builder::Engine::Mqtt(url) => {
                let settings = mqtt::Settings {
                    url: url.clone(),
                    client_id: builder
                        .name
                        .clone()
                        .unwrap_or_else(|| format!("blazesub-{connection}")),
                    origin: origin.clone(),
                    backoff,
                    at_least_once: builder.at_least_once,
                };
                Arc::new(
                    mqtt::Mqtt::connect(settings, Arc::clone(&stats), Arc::clone(&wake)).map_err(
                        |reason| Error::Bridge {
                            engine: "MQTT",
                            url,
                            reason,
                        },
                    )?,
                )
            }
        };
        let bus = builder.bus;
        let exports: Arc<[Arc<str>]> = builder.exports.iter().map(|f| Arc::from(&**f)).collect();
        let imports: Arc<[Arc<str>]> = builder.imports.iter().map(|f| Arc::from(&**f)).collect();
        let mut tasks = Vec::new();
        let mut stops = Vec::new();

        // Exports: one hidden tap per filter, read by one task.
        let mut taps = Vec::with_capacity(exports.len());
        for (i, filter) in exports.iter().enumerate() {
            let owner = export::owner(Arc::clone(&exports), i);
            taps.push(bus.subscribe_tap(filter, builder.export_buffer, owner)?);
        }
        if !taps.is_empty() {
            let stop = Arc::new(Notify::new());
            let exporter = Exporter {
                taps,
                exports,
                codec: Arc::clone(&builder.codec),
                transport: Arc::clone(&transport),
                stats: Arc::clone(&stats),
                outgoing_buffer: builder.outgoing_buffer,
                wake,
                stop: Arc::clone(&stop),
            };
            tasks.push(tokio::spawn(exporter.run()));
            stops.push(stop);
        }

        // Imports: watch the bus's interest, reconcile it upstream.
        let mut unwatch: Box<dyn FnOnce() + Send> = Box::new(|| {});
        if !imports.is_empty() {
            let table = Arc::new(Table::default());
            let watcher: Arc<dyn Interest> = Arc::clone(&table) as Arc<dyn Interest>;
            for filter in bus.inner.trie.watch(Arc::clone(&watcher)) {
                watcher.changed(&filter, true);
            }
            let trie = Arc::downgrade(&bus.inner.trie);
            unwatch = Box::new(move || {
                if let Some(trie) = trie.upgrade() {
                    trie.unwatch(&watcher);
                }
            });
            let importer = Arc::new(Importer {
                bus,
                imports,
                codec: builder.codec,
                stats: Arc::clone(&stats),
                origin: Arc::from(origin.as_str()),
                import_buffer: builder.import_buffer,
                stopped: tokio::sync::watch::channel(false).0,
            });
            let stop = Arc::new(Notify::new());
            tasks.push(tokio::spawn(import::reconcile(
                table,
                Arc::clone(&transport),
                importer,
                Arc::clone(&stop),
            )));
            stops.push(stop);
        }
        Ok(Self {
            stats,
            transport,
            running: Mutex::new(Some(Running {
                tasks,
                stops,
                unwatch,
            })),
            runtime,
            closed: AtomicBool::new(false),
        })
    }

    /// A snapshot of the bridge's counters.
    pub fn stats(&self) -> BridgeStats {
        let connected = !self.closed.load(Ordering::Acquire) && self.transport.connected();
        self.stats.snapshot(connected)
    }

    /// Stops the bridge: no more exports or imports; sends what the export
    /// taps and task still hold if connected (else counts it as dropped),
    /// removes the upstream subscriptions, waits for the local delivery in
    /// progress, counts as dropped the imports still waiting for local
    /// delivery (in the bridge's queues, and those the client had received
    /// for it), and closes the connection (each step bounded by a few
    /// seconds). Once it returns, no local subscriber gets an import and
    /// the counts are final, unless a local handler held its delivery past
    /// that bound (five seconds).
    /// Calling it again does nothing.
    ///
    /// Cancel-safe: the closing runs as a task of the bridge's runtime, so
    /// dropping this future (a timeout around it, a `select!`) does not stop
    /// it halfway; it finishes in the background, connection closed.
    pub async fn close(&self) -> Result<(), Error> {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(running) = running else {
            return Ok(());
        };
        self.closed.store(true, Ordering::Release);
        let transport = Arc::clone(&self.transport);
        let closing = self.runtime.spawn(async move {
            for task in running.stop() {
                let abort = task.abort_handle();
                if tokio::time::timeout(Duration::from_secs(5), task)
                    .await
                    .is_err()
                {
                    abort.abort();
                }
            }
            transport.close().await;
        });
        // Err only if the runtime is shutting down, which stops the bridge's
        // tasks anyway.
        let _ = closing.await;
        Ok(())
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let running = self
            .running
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(running) = running {
            for task in running.stop() {
                task.abort();
            }
        }
    }
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("stats", &self.stats())
            .finish()
    }
}
