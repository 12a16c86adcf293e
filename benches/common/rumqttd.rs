//! rumqttd embedded in the bench process, for the comparison benches: one
//! `rumqttd::Broker` and in-process clients ("local links"), no sockets; and
//! [`BusVsMqtt`], BlazeSub's broker-comparison workload, which both
//! `vs_rumqttd` and `delivery_modes` run.
//!
//! # How it is set up
//!
//! `Broker::new(config)` builds rumqttd's router and runs it on a thread of
//! its own (`router-0`). That is all the in-process clients need:
//! `broker.link(client_id)` registers a connection with the router and
//! returns its `(LinkTx, LinkRx)` pair, exactly what rumqttd's network
//! servers create for each TCP client, minus the socket and the MQTT
//! encoding. `Broker::start()` would only add listeners (and refuses to run
//! without one), so it is never called: **no port is opened**.
//!
//! The configuration ([`config`]) has only a router section:
//! - `max_connections`: what the workload needs plus a margin. rumqttd
//!   rejects a connection past the limit *silently* (the link never gets its
//!   acknowledgement and `broker.link` would block forever), so it is sized
//!   from the caller's count.
//! - `max_outgoing_packet_count` = 200: how many messages the router moves
//!   from a filter's log to a link per scheduling turn; 200 matches a link's
//!   outgoing buffer (rumqttd's `MAX_CHANNEL_CAPACITY`), as in rumqttd's own
//!   sample `rumqttd.toml`.
//! - `max_segment_size` = 32 KiB, `max_segment_count` = 3: rumqttd appends
//!   every publish to the in-memory log of each filter it matches (a log per
//!   filter, never freed), and subscribers read the logs with cursors. A
//!   subscriber that falls behind the retained segments silently skips
//!   messages (a "cursor jump"), which would make an end-to-end wait hang.
//!   The benches wait for every burst (at most 1,000 publishes) to be
//!   delivered before the next, so the lag of the busiest log (`test/#` sees
//!   every publish) is at most one burst; a segment holds about 700 of these
//!   messages (rumqttd counts 4 bytes + topic + payload, about 46 bytes), and
//!   after dropping the oldest segment a log still holds at least 3 full
//!   ones, about 2,100 messages. Larger segments would only cost memory: a
//!   log fills to its limit whatever the lag, and each retained message
//!   takes a few hundred bytes of RAM.
//! - No server (`v4`/`v5`/`ws`), no console, no Prometheus exporter, no
//!   metrics timer, no bridge, no cluster: nothing that opens a socket or
//!   runs a thread besides the router.
//!
//! Publishes are QoS 0 (`LinkTx::publish`), as BlazeSub's and mochi's
//! in-process publishes are: no acknowledgements, no inflight limits.
//!
//! # Completion
//!
//! Each subscription is its own link, as if each were its own MQTT client.
//! Every link gets a reader task that takes its notifications and adds one
//! to a shared `AtomicU64` per `Forward` (one delivered message), the same
//! completion rule as the blazesub benches' handlers. When the router pauses
//! a link whose outgoing buffer is full (`Notification::Unschedule`), the
//! reader wakes it again (`LinkRx::wake`), which is what rumqttd's own
//! network links do.
//!
//! The readers are tokio tasks on a runtime of two worker threads owned by
//! [`Rumqttd`], not one OS thread each: the comparison workload has 5,000
//! links, and 5,000 threads on two cores would measure the kernel's
//! scheduler. rumqttd's network links are tokio tasks too.
//!
//! # Shutdown
//!
//! Dropping [`Rumqttd`] (or a [`Publisher`] / [`Churn`]) disconnects its
//! links, so the router frees their state and the reader tasks end, then
//! shuts the reader runtime down. rumqttd has no way to stop its router
//! thread: it stays parked on its empty channel, costs nothing, and does not
//! keep the process alive (it is not joined).

#![allow(dead_code)] // each bench target uses a different part of this module

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{Disconnect, DisconnectReasonCode, Packet};
use rumqttd::{Broker, Config, Notification, RouterConfig};

use super::wait_for;

/// The router configuration used by every comparison bench (see the module
/// docs for the reason behind each number).
pub fn config(max_connections: usize) -> Config {
    Config {
        id: 0,
        router: RouterConfig {
            max_connections,
            max_outgoing_packet_count: 200,
            max_segment_size: 32 * 1024,
            max_segment_count: 3,
            ..RouterConfig::default()
        },
        ..Config::default()
    }
}

/// An embedded broker, its subscriber links and their reader tasks.
pub struct Rumqttd {
    broker: Broker,
    readers: Option<tokio::runtime::Runtime>,
    next_client: AtomicUsize,
    /// The subscriber links' senders, kept to disconnect them on drop.
    subscribers: Vec<LinkTx>,
    /// Subscription acknowledgements received by the readers.
    subacks: Arc<AtomicU64>,
}

impl Rumqttd {
    /// Starts a broker that accepts `connections` links (plus a margin).
    pub fn start(connections: usize) -> Self {
        let broker = Broker::new(config(connections + 16));
        let readers = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("rumqttd-readers")
            .build()
            .expect("reader runtime");
        Self {
            broker,
            readers: Some(readers),
            next_client: AtomicUsize::new(0),
            subscribers: Vec::new(),
            subacks: Arc::new(AtomicU64::new(0)),
        }
    }

    fn link(&self, role: &str) -> (LinkTx, LinkRx) {
        let n = self.next_client.fetch_add(1, Ordering::Relaxed);
        self.broker
            .link(&format!("{role}-{n}"))
            .expect("rumqttd local link")
    }

    fn readers(&self) -> &tokio::runtime::Runtime {
        self.readers.as_ref().expect("reader runtime")
    }

    /// One link per filter, each subscribed to its filter, each drained by a
    /// reader task that adds one to `delivered` per message received. Returns
    /// once the router has acknowledged every subscription.
    pub fn subscribe_links<S: AsRef<str>>(&mut self, filters: &[S], delivered: &Arc<AtomicU64>) {
        let target = self.subacks.load(Ordering::Acquire) + filters.len() as u64;
        for filter in filters {
            let (mut tx, rx) = self.link("sub");
            tx.subscribe(filter.as_ref()).expect("subscribe");
            self.readers().spawn(read_link(
                rx,
                Arc::clone(delivered),
                Arc::clone(&self.subacks),
            ));
            self.subscribers.push(tx);
        }
        wait_for(&self.subacks, target);
    }

    /// A link that publishes.
    pub fn publisher(&self) -> Publisher {
        let (tx, rx) = self.link("pub");
        Publisher { tx, _rx: rx }
    }

    /// A link for subscribe + unsubscribe pairs; its reader counts the
    /// acknowledgements.
    pub fn churn(&self) -> Churn {
        let (tx, rx) = self.link("churn");
        let acks = Arc::new(AtomicU64::new(0));
        self.readers().spawn(read_link(
            rx,
            Arc::new(AtomicU64::new(0)),
            Arc::clone(&acks),
        ));
        Churn { tx, acks }
    }
}

impl Drop for Rumqttd {
    fn drop(&mut self) {
        for tx in &mut self.subscribers {
            disconnect(tx);
        }
        if let Some(readers) = self.readers.take() {
            readers.shutdown_background();
        }
    }
}

/// Asks the router to drop a link (as an MQTT DISCONNECT would).
fn disconnect(tx: &mut LinkTx) {
    let packet = Packet::Disconnect(
        Disconnect {
            reason_code: DisconnectReasonCode::NormalDisconnection,
        },
        None,
    );
    // `LinkTx::send` is async only in name: its body has no await point (it
    // queues the packet and sends the router an event on a blocking bounded
    // channel), so one poll completes it.
    let mut send = std::pin::pin!(tx.send(packet));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let _ = send.as_mut().poll(&mut cx);
}

/// Drains one link: one `delivered` per message, one `acks` per subscribe
/// or unsubscribe acknowledgement; wakes the link when the router paused it
/// for a full buffer. Ends when the router drops the link.
async fn read_link(mut rx: LinkRx, delivered: Arc<AtomicU64>, acks: Arc<AtomicU64>) {
    use rumqttd::local::LinkError;
    loop {
        match rx.next().await {
            Ok(Some(Notification::Forward(_))) => {
                delivered.fetch_add(1, Ordering::Release);
            }
            Ok(Some(Notification::Unschedule)) => {
                if rx.wake().await.is_err() {
                    return;
                }
            }
            // rumqttd does not export its `Ack` type. On these links every
            // acknowledgement answers a subscribe or an unsubscribe: QoS 0
            // needs none, and the connection's own was taken by `link()`.
            Ok(Some(Notification::DeviceAck(_))) => {
                acks.fetch_add(1, Ordering::Release);
            }
            Ok(_) => {}
            Err(LinkError::Recv(_)) => return,
            Err(err) => panic!("rumqttd link: {err}"),
        }
    }
}

/// A publishing link (QoS 0).
pub struct Publisher {
    tx: LinkTx,
    _rx: LinkRx,
}

impl Publisher {
    /// Hands one publish to the router; returns once it is queued.
    #[inline]
    pub fn publish(&mut self, topic: &Bytes, payload: &Bytes) {
        self.tx
            .publish(topic.clone(), payload.clone())
            .expect("rumqttd publish");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        disconnect(&mut self.tx);
    }
}

/// A link that subscribes and unsubscribes.
pub struct Churn {
    tx: LinkTx,
    acks: Arc<AtomicU64>,
}

impl Churn {
    /// Subscribes to and unsubscribes from each filter, back to back (the
    /// link does not wait for one acknowledgement before sending the next
    /// request), and returns once the router has acknowledged all of them.
    pub fn pairs<S: AsRef<str>>(&mut self, filters: &[S]) {
        let target = self.acks.load(Ordering::Acquire) + 2 * filters.len() as u64;
        for filter in filters {
            self.tx.subscribe(filter.as_ref()).expect("subscribe");
            self.tx.unsubscribe(filter.as_ref()).expect("unsubscribe");
        }
        wait_for(&self.acks, target);
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        disconnect(&mut self.tx);
    }
}

/// The payload of BlazeSub's comparison benchmarks.
pub const PAYLOAD: &[u8] = b"test message payload";

/// The wildcard subscriptions of BlazeSub's comparison workload.
pub const WILDCARDS: [&str; 5] = [
    "test/+/0/level",
    "test/topic/+/level",
    "test/topic/0/#",
    "test/#",
    "+/topic/10/level",
];

/// Publishes go round-robin over this many topics.
pub const PUBLISH_TOPICS: usize = 100;

/// BlazeSub's broker-comparison workload (`BenchmarkBusVsMQTT` in its
/// `mqtt_comparison_test.go`, the "base publishing" of seed `001`): `topics`
/// topics `test/topic/{i}/exact`, `exact_subscriptions` subscriptions, the
/// `j`-th on topic `j % topics`, plus the five [`WILDCARDS`]; publishes
/// round-robin over 100 topics, 80 of them `test/topic/{i}/exact` and 20
/// `test/wildcard/{i % 20}/level`. With 1,000 topics and 4,995 exact
/// subscriptions a publish matches 5.02 subscriptions on average.
pub struct BusVsMqtt {
    /// Every subscription's filter, exact ones first.
    pub filters: Vec<String>,
    /// The distinct exact filters (`test/topic/{i}/exact`).
    pub exact: Vec<String>,
    /// The publish topics, in round-robin order.
    pub topics: Vec<String>,
    /// The same, as `Bytes` for rumqttd.
    pub topic_bytes: Vec<Bytes>,
    /// How many subscriptions each publish topic matches.
    pub deliveries: Vec<u64>,
}

impl BusVsMqtt {
    pub fn new(topics: usize, exact_subscriptions: usize) -> Self {
        let exact: Vec<String> = (0..topics)
            .map(|i| format!("test/topic/{i}/exact"))
            .collect();
        let filters: Vec<String> = (0..exact_subscriptions)
            .map(|j| exact[j % topics].clone())
            .chain(WILDCARDS.iter().map(|w| (*w).to_owned()))
            .collect();
        let publish_topics: Vec<String> = (0..PUBLISH_TOPICS)
            .map(|i| {
                if i < 80 {
                    exact[i % topics].clone()
                } else {
                    format!("test/wildcard/{}/level", i % 20)
                }
            })
            .collect();
        let deliveries = publish_topics
            .iter()
            .map(|t| {
                filters
                    .iter()
                    .filter(|f| blazesub::topic::matches(f, t))
                    .count() as u64
            })
            .collect();
        Self {
            topic_bytes: publish_topics
                .iter()
                .map(|t| Bytes::from(t.clone()))
                .collect(),
            filters,
            exact,
            topics: publish_topics,
            deliveries,
        }
    }

    /// The full workload in bench mode; a tenth of it (100 topics, 500
    /// subscriptions) in test mode, where every path runs once in a debug
    /// build.
    pub fn for_mode() -> Self {
        if super::bench_mode() {
            Self::new(1_000, 4_995)
        } else {
            Self::new(100, 495)
        }
    }

    /// Subscriptions a publish matches, on average over the round.
    pub fn deliveries_per_publish(&self) -> f64 {
        self.deliveries.iter().sum::<u64>() as f64 / self.deliveries.len() as f64
    }

    /// `bursts` bursts of `size` publishes from this thread, round-robin
    /// from `cursor` on; each burst is waited for until `delivered` has
    /// counted every delivery it produces. Returns the time until the last
    /// delivery (end to end) and the time spent in the publish calls alone.
    pub fn bursts(
        &self,
        publish: &mut impl FnMut(usize),
        delivered: &AtomicU64,
        cursor: &mut usize,
        bursts: u64,
        size: usize,
    ) -> (Duration, Duration) {
        let mut target = delivered.load(Ordering::Acquire);
        let mut calls = Duration::ZERO;
        let start = Instant::now();
        for _ in 0..bursts {
            let burst = Instant::now();
            for _ in 0..size {
                publish(*cursor);
                target += self.deliveries[*cursor];
                *cursor = (*cursor + 1) % PUBLISH_TOPICS;
            }
            calls += burst.elapsed();
            wait_for(delivered, target);
        }
        (start.elapsed(), calls)
    }
}
