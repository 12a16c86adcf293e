//! The MQTT 5 transport, on the `rumqttc` client's v5 module (feature
//! `mqtt`).
//!
//! - Topics go on the wire as they are. Metadata travels as MQTT 5 user
//!   properties, and the sending node's id as the user property
//!   [`ORIGIN_PROPERTY`], so a node drops its own messages even on brokers
//!   that ignore No Local (rumqttd among them); No Local is set too.
//! - **One upstream subscription per filter string.** MQTT keys a client's
//!   subscriptions by filter, so two local filters that need the same
//!   upstream filter share one subscription (reference-counted here), and
//!   each subscription carries its own **subscription identifier**: an
//!   incoming message names the subscriptions it matched, and goes to
//!   exactly their targets. A broker that sends no identifiers gets the
//!   message delivered to every subscription whose filter matches.
//! - **Reconnects are paced here**: rumqttc reconnects as fast as it is
//!   polled, so after an error the event-loop task sleeps a jittered
//!   exponential delay. The session starts clean (unless
//!   `at_least_once`, when the broker may have kept it), so on every ConnAck the
//!   bridge subscribes again to everything in its own table (from a task
//!   of its own: the event loop is never polled by a task that waits on the
//!   client's request channel, and never waits on it itself).
//! - **Closing ends the event loop**: `close` sends DISCONNECT after what
//!   the client has queued, and the event-loop task ends once it is written
//!   (or at once if the connection is down); nothing reconnects afterwards.
//! - **QoS 0 by default**: at most once, as the NATS transport. With
//!   `at_least_once` (QoS 1): exports count as `sent` at the broker's
//!   PUBACK; at a connection error the publishes rumqttc held (written and
//!   unacknowledged, or still queued) are taken out of its `pending` list
//!   (which a reconnect into a new session clears) and put back in front
//!   after the next ConnAck, as new publishes; the session is kept by the
//!   broker for the given expiry (clean start off after the first
//!   connection, which starts its own: an earlier bridge's session holds
//!   subscriptions this table does not know), so imports published while
//!   the connection was down arrive after it; `close` waits (up to
//!   2 s) for the acknowledgements before its DISCONNECT.
//! - A message MQTT cannot carry is refused before it reaches the client,
//!   and counted as dropped: a packet over [`MAX_PACKET`], a topic or
//!   metadata key or value over [`MAX_STRING`] bytes (rumqttc would write
//!   its length truncated, and the broker close the connection), or one
//!   with a control character or a Unicode noncharacter (which the bus
//!   allows and MQTT 5 does not; mosquitto closes the connection), and a
//!   topic that begins with `$SYS` or `$share`, which brokers keep for
//!   themselves (mosquitto drops a client's publish to any topic with that
//!   prefix, `$SYSTEM/x` too; other `$` topics travel as they are). A local
//!   filter with one, or an upstream filter over [`MAX_STRING`] bytes (the
//!   intersection of a local filter and an import can be longer than
//!   either) or whose SUBSCRIBE is over the broker's Maximum Packet Size,
//!   is not subscribed upstream (logged), so it cannot keep
//!   the connection down by being subscribed again on each ConnAck.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::{
    Filter, Packet, PubAckReason, PublishProperties, SubscribeProperties,
};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions, Request};
use rumqttc::Outgoing as Written;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::backoff::Backoff;
use super::stats::Counters;
use super::transport::{BoxFuture, Deliver, Incoming, Outgoing, SendError, Transport, Upstream};
use crate::message::Metadata;
use crate::topic::matches;

/// The user property that carries the sending node's id.
pub(crate) const ORIGIN_PROPERTY: &str = "blazesub-origin";

/// The largest packet the bridge accepts and sends (1 MiB, NATS's default
/// `max_payload`). rumqttc's own default is 10 KiB, and a packet over its
/// limit, either way, ends the connection; so larger incoming packets are
/// allowed up to this, and larger outgoing ones are refused and counted
/// before they reach the client.
const MAX_PACKET: u32 = 1 << 20;

/// The longest string MQTT can carry (its length is a u16): topic names,
/// and each user property's key and value.
const MAX_STRING: usize = u16::MAX as usize;

/// Whether MQTT 5 can carry `text` as a string (a topic, a filter, a user
/// property's key or value): no control characters (U+0000–U+001F,
/// U+007F–U+009F) and no Unicode noncharacters. The bus allows them in
/// topics and metadata; MQTT 5 lets a broker treat them as a malformed
/// packet, and mosquitto closes the connection, losing what the client had
/// queued behind it.
fn mqtt_can_carry(text: &str) -> bool {
    !text.chars().any(|c| {
        let code = u32::from(c);
        c.is_control() || (0xFDD0..=0xFDEF).contains(&code) || code & 0xFFFE == 0xFFFE
    })
}

/// One filter's upstream subscription and who receives its messages.
struct Entry {
    id: usize,
    targets: Vec<(u64, Deliver)>,
}

#[derive(Default)]
struct Table {
    by_filter: HashMap<String, Entry>,
    next_id: usize,
    next_target: u64,
}

struct Shared {
    client: AsyncClient,
    table: Mutex<Table>,
    connected: AtomicBool,
    /// `close` has begun: the event loop ends at the DISCONNECT or the next
    /// error instead of reconnecting.
    closing: AtomicBool,
    /// Publishes handed to the client and not yet written (QoS 0) or
    /// acknowledged (QoS 1), nor counted lost: see [`Shared::written`].
    unsettled: AtomicU64,
    /// QoS 1 for exports and imports (`at_least_once`), else QoS 0.
    qos: QoS,
    /// The broker's ConnAck said its Maximum QoS is 0: exports go with
    /// QoS 0 even with `at_least_once` (it closes the connection of a
    /// client that publishes with more).
    broker_qos_0: AtomicBool,
    stats: Arc<Counters>,
    /// The broker's Maximum Packet Size from its last ConnAck (0: none
    /// given). rumqttc fails the connection on a larger outgoing packet,
    /// losing what it had queued behind it; the bridge refuses it first.
    broker_max_packet: AtomicU32,
}

/// # Counting what the client loses
/// rumqttc queues a publish in its request channel; at a connection error
/// it moves what the channel holds (and, QoS 1, what it wrote and has no
/// PUBACK for) into its `pending` list, which a reconnect into a new
/// session clears. So a QoS 0 publish is `sent` only when the event loop
/// writes it (`Event::Outgoing(Publish)`), and one cleared at a
/// disconnect, or left queued when the loop ends, is `dropped`; a QoS 1
/// publish is `sent` at its PUBACK, and is put back after the reconnect
/// instead of cleared. `unsettled` makes each count once: whoever takes a
/// publish out of it counts it.
impl Shared {
    /// The QoS exports go with now.
    fn export_qos(&self) -> QoS {
        if self.broker_qos_0.load(Ordering::Acquire) {
            QoS::AtMostOnce
        } else {
            self.qos
        }
    }

    /// One publish written to the connection (QoS 0) or acknowledged
    /// (QoS 1).
    fn written(&self) {
        if take(&self.unsettled, 1) == 1 {
            Counters::add(&self.stats.sent, 1);
        }
    }

    /// `n` publishes the client will never write.
    fn lost(&self, n: u64) {
        Counters::add(&self.stats.dropped, take(&self.unsettled, n));
    }

    /// The event loop has ended: what it had not written is lost.
    fn lost_the_rest(&self) {
        Counters::add(
            &self.stats.dropped,
            self.unsettled.swap(0, Ordering::AcqRel),
        );
    }
}

/// Takes up to `n` from `count`; returns how many it took.
fn take(count: &AtomicU64, n: u64) -> u64 {
    match count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
        Some(now - now.min(n))
    }) {
        Ok(before) => before.min(n),
        Err(_) => 0,
    }
}

/// A publish counted in `unsettled` and not yet handed to the client: taken
/// back out of the count unless handed over, however its future ends.
struct Unhanded<'a>(Option<&'a AtomicU64>);

impl Unhanded<'_> {
    fn handed(mut self) {
        self.0 = None;
    }

    /// Takes it back; false if the event loop's end counted it already.
    fn take_back(mut self) -> bool {
        self.0.take().is_some_and(|count| take(count, 1) == 1)
    }
}

impl Drop for Unhanded<'_> {
    fn drop(&mut self) {
        if let Some(count) = self.0.take() {
            take(count, 1);
        }
    }
}

/// Takes the publishes out of the client's `pending` list after a
/// connection error (its request channel moved there): a reconnect into a
/// new session would clear them unsent. Keeps the other requests there.
fn take_pending_publishes(event_loop: &mut EventLoop) -> Vec<Request> {
    let mut publishes = Vec::new();
    let mut rest = std::collections::VecDeque::new();
    for request in event_loop.pending.drain(..) {
        if matches!(request, Request::Publish(_)) {
            publishes.push(request);
        } else {
            rest.push_back(request);
        }
    }
    event_loop.pending = rest;
    publishes
}

pub(crate) struct Mqtt {
    shared: Arc<Shared>,
    origin: String,
    /// Taken by `close`, which waits for the loop to end.
    event_loop: Mutex<Option<JoinHandle<()>>>,
}

pub(crate) struct Settings {
    pub(crate) url: String,
    /// The MQTT client id (unique per broker).
    pub(crate) client_id: String,
    pub(crate) origin: String,
    pub(crate) backoff: Backoff,
    /// `Some(session expiry)`: QoS 1 in a session the broker keeps.
    pub(crate) at_least_once: Option<Duration>,
}

/// `mqtt://host:port` (port 1883 if absent) → (host, port).
fn parse_url(url: &str) -> Result<(String, u16), String> {
    let rest = url
        .strip_prefix("mqtt://")
        .or_else(|| url.strip_prefix("tcp://"))
        .ok_or_else(|| "an MQTT URL starts with mqtt:// (TLS is not supported here)".to_owned())?;
    let rest = rest.trim_end_matches('/');
    match rest.rsplit_once(':') {
        Some((host, port)) => port
            .parse()
            .map(|port| (host.to_owned(), port))
            .map_err(|_| format!("invalid port {port:?}")),
        None => Ok((rest.to_owned(), 1883)),
    }
}

impl Mqtt {
    pub(crate) fn connect(
        settings: Settings,
        stats: Arc<Counters>,
        wake: Arc<Notify>,
    ) -> Result<Self, String> {
        let (host, port) = parse_url(&settings.url)?;
        let mut options = MqttOptions::new(settings.client_id, host, port);
        let qos = match settings.at_least_once {
            Some(expiry) => {
                // Rounded up, and short of u32::MAX, which means never.
                let seconds = expiry
                    .as_secs()
                    .saturating_add(u64::from(expiry.subsec_nanos() > 0))
                    .min(u64::from(u32::MAX - 1)) as u32;
                // The first connection starts a session of its own (see
                // the ConnAck); reconnects resume it.
                options.set_clean_start(true);
                options.set_session_expiry_interval(Some(seconds));
                QoS::AtLeastOnce
            }
            None => {
                options.set_clean_start(true);
                QoS::AtMostOnce
            }
        };
        options.set_keep_alive(Duration::from_secs(10));
        options.set_max_packet_size(Some(MAX_PACKET));
        let (client, event_loop) = AsyncClient::new(options, 1_024);
        let shared = Arc::new(Shared {
            client,
            table: Mutex::new(Table::default()),
            connected: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            unsettled: AtomicU64::new(0),
            qos,
            broker_qos_0: AtomicBool::new(false),
            stats: Arc::clone(&stats),
            broker_max_packet: AtomicU32::new(0),
        });
        let event_loop = tokio::spawn(run_event_loop(
            event_loop,
            Arc::downgrade(&shared),
            stats,
            wake,
            settings.backoff,
            settings.origin.clone(),
        ));
        Ok(Self {
            shared,
            origin: settings.origin,
            event_loop: Mutex::new(Some(event_loop)),
        })
    }
}

impl Drop for Mqtt {
    fn drop(&mut self) {
        let event_loop = self.event_loop.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(event_loop) = event_loop.take() {
            event_loop.abort();
        }
        self.shared.lost_the_rest();
    }
}

fn lock_loop(
    event_loop: &Mutex<Option<JoinHandle<()>>>,
) -> std::sync::MutexGuard<'_, Option<JoinHandle<()>>> {
    event_loop.lock().unwrap_or_else(|e| e.into_inner())
}

fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls the event loop until `close`: counts connections, paces
/// reconnects, resubscribes after each ConnAck, hands publishes to their
/// targets. rumqttc reconnects whenever it is polled after an error, so
/// once `close` has begun this returns at the DISCONNECT it wrote (all
/// queued publishes went before it) or at the first error.
async fn run_event_loop(
    mut event_loop: EventLoop,
    shared: Weak<Shared>,
    stats: Arc<Counters>,
    wake: Arc<Notify>,
    backoff: Backoff,
    origin: String,
) {
    let mut attempts = 0;
    let mut connected_at: Option<Instant> = None;
    // QoS 1: the publishes a lost connection left unacknowledged or
    // unwritten, handed back to rumqttc once connected (`feed_retry`).
    let mut retry: VecDeque<Request> = VecDeque::new();
    // rumqttc's window for QoS 1 publishes: the broker's Receive Maximum.
    let mut window = u16::MAX;
    loop {
        if connected_at.is_some() && !retry.is_empty() {
            if let Some(shared) = shared.upgrade() {
                feed_retry(&mut event_loop, &mut retry, window, &shared);
            }
        }
        let event = event_loop.poll().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                let broker_max = ack.properties.as_ref().and_then(|p| p.max_packet_size);
                shared
                    .broker_max_packet
                    .store(broker_max.unwrap_or(0), Ordering::Release);
                let qos_0 = ack.properties.as_ref().and_then(|p| p.max_qos) == Some(0);
                if qos_0 && shared.qos == QoS::AtLeastOnce {
                    tracing::warn!("the MQTT broker allows QoS 0 only: exports go at most once");
                    for request in &mut retry {
                        if let Request::Publish(publish) = request {
                            publish.qos = QoS::AtMostOnce;
                            publish.pkid = 0;
                        }
                    }
                }
                shared.broker_qos_0.store(qos_0, Ordering::Release);
                window = ack
                    .properties
                    .as_ref()
                    .and_then(|p| p.receive_max)
                    .unwrap_or(u16::MAX);
                connected_at = Some(Instant::now());
                if shared.qos == QoS::AtLeastOnce {
                    // Resume this session from now on. Not at the first
                    // connection: a session left by an earlier bridge of
                    // the same name holds subscriptions this bridge's table
                    // does not know, whose identifiers it numbers afresh.
                    event_loop.options.set_clean_start(false);
                }
                shared.connected.store(true, Ordering::Release);
                Counters::add(&stats.connects, 1);
                tracing::info!("bridge connected to the MQTT broker");
                resubscribe(&shared);
                wake.notify_one();
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                dispatch(&shared, publish, &origin, &stats);
            }
            // A QoS 0 publish (packet id 0) is settled once written, a
            // QoS 1 one at its PUBACK.
            Ok(Event::Outgoing(Written::Publish(0))) => shared.written(),
            Ok(Event::Incoming(Packet::PubAck(ack))) => match ack.reason {
                PubAckReason::Success | PubAckReason::NoMatchingSubscribers => shared.written(),
                reason => {
                    shared.lost(1);
                    tracing::warn!(?reason, "the MQTT broker refused an export");
                }
            },
            Ok(Event::Incoming(Packet::Disconnect(_))) => {
                shared.connected.store(false, Ordering::Release);
            }
            Ok(Event::Outgoing(Written::Disconnect)) if shared.closing.load(Ordering::Acquire) => {
                shared.connected.store(false, Ordering::Release);
                return;
            }
            Ok(_) => {}
            Err(_) if shared.closing.load(Ordering::Acquire) => {
                shared.connected.store(false, Ordering::Release);
                shared.lost_the_rest();
                return;
            }
            Err(error) => {
                let publishes = take_pending_publishes(&mut event_loop);
                if shared.qos == QoS::AtMostOnce {
                    shared.lost(publishes.len() as u64);
                } else {
                    retry.extend(publishes);
                }
                if shared.connected.swap(false, Ordering::AcqRel) {
                    tracing::warn!(%error, "bridge disconnected from the MQTT broker; reconnecting");
                } else {
                    tracing::debug!(%error, "MQTT connect failed");
                }
                drop(shared);
                // The delay grows until a connection has held a while: one
                // that a broker ends at once (what it cannot take, sent
                // again at every ConnAck) is not retried at the shortest.
                if connected_at
                    .take()
                    .is_some_and(|at| at.elapsed() >= STEADY_CONNECTION)
                {
                    attempts = 0;
                }
                tokio::time::sleep(backoff.delay(attempts)).await;
                attempts += 1;
            }
        }
    }
}

/// A connection that held this long resets the reconnect delay.
const STEADY_CONNECTION: Duration = Duration::from_secs(1);

/// QoS 1: hands the next publish to send again to rumqttc, when rumqttc
/// would read a new request itself: its window has room and no packet id
/// collision waits. rumqttc writes its `pending` list without that check,
/// and holds only one publish whose packet id is still in flight: others
/// would be lost (a link with some latency lost 64–71% of 1,000). One at a
/// time, as each written publish is an event that comes back here; with a
/// packet id from the window. One over the broker's Maximum Packet Size (a
/// broker restarted with a smaller one) is dropped and counted: rumqttc
/// would fail each connection on it.
fn feed_retry(
    event_loop: &mut EventLoop,
    retry: &mut VecDeque<Request>,
    window: u16,
    shared: &Shared,
) {
    let busy = event_loop
        .pending
        .iter()
        .any(|request| matches!(request, Request::Publish(_)))
        || event_loop.state.inflight() >= window
        || event_loop.state.collision.is_some();
    if busy {
        return;
    }
    let broker_max = shared.broker_max_packet.load(Ordering::Acquire) as usize;
    while let Some(request) = retry.pop_front() {
        let Request::Publish(mut publish) = request else {
            continue;
        };
        // With its packet id (2 bytes), which `size` leaves out at id 0.
        let size = publish.size() + 2;
        if broker_max > 0 && size > broker_max {
            shared.lost(1);
            tracing::warn!(
                size,
                broker_max,
                "an export to send again is over the MQTT broker's Maximum Packet Size; dropped"
            );
            continue;
        }
        publish.pkid = 0;
        event_loop.pending.push_back(Request::Publish(publish));
        return;
    }
}

/// Whether `topic` is one brokers keep for themselves, where they drop
/// what a client publishes (at QoS 0 mosquitto says nothing, so the
/// export would count as sent and reach nobody): its `$SYS` namespace, and
/// shared subscriptions' `$share`. mosquitto compares only the prefix
/// (`strncmp(topic, "$SYS", 4)`, and `"$share"`, 6), so `$SYSTEM/x` and
/// `$shared/x` are dropped too. Other topics that start with `$` travel as
/// they are.
fn broker_owned(topic: &str) -> bool {
    topic.starts_with("$SYS") || topic.starts_with("$share")
}

/// The most a SUBSCRIBE for `filter` takes: a fixed header of up to 5
/// bytes, the packet id (2), the properties' length (up to 4) and the
/// subscription identifier (up to 5), the filter's length (2) and options
/// (1).
fn subscribe_size(filter: &str) -> usize {
    filter.len() + 19
}

/// Why the broker cannot take a SUBSCRIBE for `filter` now, if it cannot:
/// one over its Maximum Packet Size fails the connection (rumqttc or the
/// broker ends it), and, subscribed again on every ConnAck, every
/// connection after it.
fn over_broker_max(shared: &Shared, filter: &str) -> Option<String> {
    let broker_max = shared.broker_max_packet.load(Ordering::Acquire) as usize;
    let size = subscribe_size(filter);
    (broker_max > 0 && size > broker_max).then(|| {
        format!("its SUBSCRIBE of up to {size} bytes is over the broker's Maximum Packet Size of {broker_max}")
    })
}

/// Subscribes again to every filter of the table (the session may be new),
/// from a task of its own; but for those the broker cannot take now (it
/// says its Maximum Packet Size in each ConnAck), logged.
fn resubscribe(shared: &Arc<Shared>) {
    let filters: Vec<(String, usize)> = lock(&shared.table)
        .by_filter
        .iter()
        .filter(|(filter, _)| match over_broker_max(shared, filter) {
            Some(reason) => {
                tracing::warn!(%filter, %reason, "bridge: an upstream filter the MQTT broker cannot take; not subscribed");
                false
            }
            None => true,
        })
        .map(|(filter, entry)| (filter.clone(), entry.id))
        .collect();
    if filters.is_empty() {
        return;
    }
    let client = shared.client.clone();
    let qos = shared.qos;
    tokio::spawn(async move {
        for (filter, id) in filters {
            let _ = subscribe_upstream(&client, &filter, id, qos).await;
        }
    });
}

async fn subscribe_upstream(
    client: &AsyncClient,
    filter: &str,
    id: usize,
    qos: QoS,
) -> Result<(), String> {
    let mut upstream = Filter::new(filter, qos);
    upstream.nolocal = true;
    let properties = SubscribeProperties {
        id: Some(id),
        user_properties: Vec::new(),
    };
    client
        .subscribe_many_with_properties([upstream], properties)
        .await
        .map_err(|e| e.to_string())
}

fn dispatch(
    shared: &Shared,
    publish: rumqttc::v5::mqttbytes::v5::Publish,
    origin: &str,
    stats: &Counters,
) {
    let topic = std::str::from_utf8(&publish.topic).map(str::to_owned);
    let mut from = None;
    let mut metadata = None;
    let mut ids = Vec::new();
    if let Some(properties) = publish.properties {
        ids = properties.subscription_identifiers;
        for (key, value) in properties.user_properties {
            // The origin is the first: the sender puts its own before the
            // metadata's, which may hold a key of the same name, and MQTT
            // keeps the order of user properties.
            if key == ORIGIN_PROPERTY && from.is_none() {
                from = Some(value);
            } else {
                metadata
                    .get_or_insert_with(Metadata::new)
                    .insert(key, value);
            }
        }
    }
    if from.as_deref() == Some(origin) {
        Counters::add(&stats.echoes, 1);
        return;
    }
    let raw_subject = String::from_utf8_lossy(&publish.topic).into_owned();
    let targets: Vec<Deliver> = {
        let table = lock(&shared.table);
        table
            .by_filter
            .iter()
            .filter(|(filter, entry)| {
                if ids.is_empty() {
                    topic.as_deref().is_ok_and(|t| matches(filter, t))
                } else {
                    ids.contains(&entry.id)
                }
            })
            .flat_map(|(_, entry)| entry.targets.iter().map(|(_, d)| Arc::clone(d)))
            .collect()
    };
    for deliver in targets {
        deliver(
            Incoming {
                topic: topic.clone().ok(),
                raw_subject: raw_subject.clone(),
                payload: publish.payload.clone(),
                metadata: metadata.clone(),
                origin: from.clone(),
            }
            .into(),
        );
    }
}

/// A target of one filter's subscription; dropping it removes the target,
/// and the subscription with its last target.
struct MqttUpstream {
    shared: Arc<Shared>,
    filter: String,
    target: u64,
}

impl Upstream for MqttUpstream {}

impl Drop for MqttUpstream {
    fn drop(&mut self) {
        let last = {
            let mut table = lock(&self.shared.table);
            let Some(entry) = table.by_filter.get_mut(&self.filter) else {
                return;
            };
            entry.targets.retain(|(t, _)| *t != self.target);
            let last = entry.targets.is_empty();
            if last {
                table.by_filter.remove(&self.filter);
            }
            last
        };
        // A filter the broker cannot take was left out of its
        // subscriptions (`resubscribe`), and an UNSUBSCRIBE for it would be
        // over the broker's Maximum Packet Size just as well: it would cost
        // the connection, for nothing to undo.
        if !last || over_broker_max(&self.shared, &self.filter).is_some() {
            return;
        }
        if self
            .shared
            .client
            .try_unsubscribe(self.filter.clone())
            .is_err()
        {
            let client = self.shared.client.clone();
            let filter = std::mem::take(&mut self.filter);
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = client.unsubscribe(filter).await;
                });
            }
        }
    }
}

impl Transport for Mqtt {
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), SendError>> {
        Box::pin(async move {
            let mut user_properties = vec![(ORIGIN_PROPERTY.to_owned(), self.origin.clone())];
            if let Some(metadata) = &message.metadata {
                user_properties.extend(metadata.iter().map(|(k, v)| (k.to_owned(), v.to_owned())));
            }
            // rumqttc writes each string's length as a u16 without checking
            // it: a longer one makes a malformed packet, and the broker
            // closes the connection.
            let strings = std::iter::once(&*message.topic)
                .chain(user_properties.iter().flat_map(|(k, v)| [&**k, &**v]));
            for string in strings {
                if string.len() > MAX_STRING {
                    return Err(SendError::Refused(format!(
                        "a string of {} bytes (topic, metadata key or value) is over MQTT's limit of {MAX_STRING}",
                        string.len()
                    )));
                }
                if !mqtt_can_carry(string) {
                    return Err(SendError::Refused(format!(
                        "{string:?} (topic, metadata key or value) has a control character or a noncharacter, which MQTT 5 does not carry"
                    )));
                }
            }
            if broker_owned(&message.topic) {
                return Err(SendError::Refused(format!(
                    "{:?} begins with $SYS or $share, which MQTT brokers keep for themselves and where they drop a client's publish",
                    &*message.topic
                )));
            }
            let size = message.payload.len()
                + message.topic.len()
                + user_properties
                    .iter()
                    .map(|(k, v)| k.len() + v.len() + 5)
                    .sum::<usize>();
            // Headroom for the fixed header and the other properties.
            if size + 64 > MAX_PACKET as usize {
                return Err(SendError::Refused(format!(
                    "its packet of about {size} bytes is over the bridge's MQTT limit of {MAX_PACKET}"
                )));
            }
            // At most: a fixed header of 5 bytes, the topic's length (2),
            // and the properties' length (4).
            let broker_max = self.shared.broker_max_packet.load(Ordering::Acquire);
            if broker_max > 0 && size + 11 > broker_max as usize {
                return Err(SendError::Refused(format!(
                    "its packet of up to {} bytes is over the broker's Maximum Packet Size of {broker_max}",
                    size + 11
                )));
            }
            let properties = PublishProperties {
                user_properties,
                ..PublishProperties::default()
            };
            // Counted before it is handed over: the event loop may write it
            // before this task runs again. Taken back if it is not handed
            // over, also if this future is dropped while it waits for room
            // in the client's queue (a closing exporter stops waiting).
            self.shared.unsettled.fetch_add(1, Ordering::AcqRel);
            let unhanded = Unhanded(Some(&self.shared.unsettled));
            let handed = self
                .shared
                .client
                .publish_with_properties(
                    &*message.topic,
                    self.shared.export_qos(),
                    false,
                    message.payload.clone(),
                    properties,
                )
                .await;
            match handed {
                Ok(()) => {
                    unhanded.handed();
                    Ok(())
                }
                // Not handed over: taken back, to be buffered and retried;
                // unless the loop's end already counted it dropped.
                Err(_) if unhanded.take_back() => Err(SendError::Disconnected),
                Err(_) => Ok(()),
            }
        })
    }

    fn counts_sent(&self) -> bool {
        true
    }

    fn subscribe<'a>(
        &'a self,
        filter: &'a str,
        deliver: Deliver,
    ) -> BoxFuture<'a, Result<Box<dyn Upstream>, String>> {
        Box::pin(async move {
            // Never into the table: it is subscribed again on every
            // ConnAck, and the broker would close each connection.
            if !mqtt_can_carry(filter) {
                return Err(format!(
                    "{filter:?} has a control character or a noncharacter, which MQTT 5 does not carry"
                ));
            }
            // An upstream filter is the intersection of a local filter and
            // an import, so it can be longer than either:
            // rumqttc would write its length truncated, just the same.
            if filter.len() > MAX_STRING {
                return Err(format!(
                    "a filter of {} bytes is over MQTT's limit of {MAX_STRING}",
                    filter.len()
                ));
            }
            // Not known before the first ConnAck: `resubscribe` checks then.
            if let Some(reason) = over_broker_max(&self.shared, filter) {
                return Err(reason);
            }
            let (target, new_id) = {
                let mut table = lock(&self.shared.table);
                let target = table.next_target;
                table.next_target += 1;
                let next_id = table.next_id + 1;
                let mut new_id = None;
                let entry = table.by_filter.entry(filter.to_owned()).or_insert_with(|| {
                    new_id = Some(next_id);
                    Entry {
                        id: next_id,
                        targets: Vec::new(),
                    }
                });
                entry.targets.push((target, deliver));
                if new_id.is_some() {
                    table.next_id = next_id;
                }
                (target, new_id)
            };
            let upstream = MqttUpstream {
                shared: Arc::clone(&self.shared),
                filter: filter.to_owned(),
                target,
            };
            if let Some(id) = new_id {
                // Disconnected, the request waits in the client's queue, and
                // the next ConnAck subscribes from the table anyway.
                subscribe_upstream(&self.shared.client, filter, id, self.shared.qos).await?;
            }
            Ok(Box::new(upstream) as Box<dyn Upstream>)
        })
    }

    fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire)
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.shared.closing.store(true, Ordering::Release);
            let event_loop = lock_loop(&self.event_loop).take();
            let Some(mut event_loop) = event_loop else {
                return;
            };
            // Disconnected, there is no DISCONNECT to send and nothing
            // queued can go out: the loop would only reconnect.
            if self.connected() {
                let sent = async {
                    if self.shared.qos == QoS::AtLeastOnce {
                        // The PUBACKs of what is in flight come before the
                        // DISCONNECT ends the loop.
                        while self.shared.unsettled.load(Ordering::Acquire) > 0 && self.connected()
                        {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                    let _ = self.shared.client.disconnect().await;
                    let _ = (&mut event_loop).await;
                };
                if tokio::time::timeout(Duration::from_secs(2), sent)
                    .await
                    .is_ok()
                {
                    self.shared.lost_the_rest();
                    return;
                }
            }
            event_loop.abort();
            self.shared.connected.store(false, Ordering::Release);
            self.shared.lost_the_rest();
        })
    }
}

#[cfg(test)]
mod tests {
    use super::parse_url;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("mqtt://127.0.0.1:1884").unwrap(),
            ("127.0.0.1".into(), 1884)
        );
        assert_eq!(parse_url("mqtt://broker").unwrap(), ("broker".into(), 1883));
        assert!(parse_url("nats://x:1").is_err());
        assert!(parse_url("mqtt://x:port").is_err());
    }
}
