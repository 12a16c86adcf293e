//! The bridges at their edges, as the thirty-third session's review found
//! them: strings MQTT cannot carry, a codec that panics, subjects the
//! mapping never makes, metadata named like the origin, two bridges of one
//! bus, and slow-consumer drops. Each test failed before its fix.
//!
//! Run: `cargo test --features nats,mqtt --test bridge_edges` (needs
//! `nats-server` and `mosquitto`, as the other bridge tests). Every test
//! has a time limit and fails instead of hanging.
#![cfg(all(feature = "nats", feature = "mqtt"))]
// Both broker helpers bring their own copy of `broker_process.rs`.
#![allow(clippy::duplicate_mod)]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/mosquitto.rs"]
mod mosquitto;
#[path = "common/nats_server.rs"]
mod nats_server;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::bridge::mapping::{subject_to_topic, topic_to_subject};
use blazesub::bridge::{Bridge, BridgeStats, Codec, CodecError};
use blazesub::{Bus, Metadata};
use bridge_support::{inline_bus, limit, start_node, subscribed, until, Seen};
use bytes::Bytes;
use mosquitto::Mosquitto;
use nats_server::NatsServer;

async fn mqtt_node<T>(
    bus: &Bus<T>,
    url: &str,
    name: &str,
    exports: &[&str],
    imports: &[&str],
) -> Bridge
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let builder = Bridge::builder(bus)
        .mqtt(url)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
    start_node(builder, name, exports, imports).await
}

async fn nats_node<T>(
    bus: &Bus<T>,
    url: &str,
    name: &str,
    exports: &[&str],
    imports: &[&str],
) -> Bridge
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    start_node(Bridge::builder(bus).nats(url), name, exports, imports).await
}

/// Waits until `value()` has not changed for `quiet`, at most `limit`.
async fn settle(mut value: impl FnMut() -> u64, quiet: Duration, limit: Duration) -> u64 {
    let deadline = Instant::now() + limit;
    let mut last = value();
    let mut since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = value();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            break;
        }
    }
    last
}

// ---------------------------------------------------------------------------
// MQTT: characters a bus topic may hold but MQTT (mosquitto) refuses.
// ---------------------------------------------------------------------------

/// A bus topic may hold control characters (only `+`, `#` and NUL are
/// refused); MQTT 5 forbids U+0001..U+001F and U+007F..U+009F in UTF-8
/// strings, and mosquitto closes the connection of a client that sends
/// one. The bridge refuses such an export and counts it dropped; the
/// connection stays up and the rest arrive. (Before: handed to rumqttc
/// and counted `sent`, the connection closed, and what rumqttc still held
/// cleared at the clean-start reconnect, all 51 counted `sent`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_export_with_a_control_character_in_its_topic_is_refused_and_counted() {
    let broker = Mosquitto::start();
    one_bad_export_then_fifty_good(&broker, "ctl", |a| {
        a.publish("ctl/tab\there", Bytes::from_static(b"bad"))
            .unwrap();
    })
    .await;
}

/// A broker with a Maximum Packet Size smaller than the bridge's own
/// limit (mosquitto's `max_packet_size`, sent in its ConnAck): an export
/// over it is refused and counted dropped, and the connection stays up.
/// (Before: rumqttc failed the connection on it, and the 50 exports queued
/// behind it were cleared at the clean-start reconnect, counted `sent`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_export_over_the_brokers_maximum_packet_size_is_refused_and_counted() {
    let broker = Mosquitto::start_with("max_packet_size 2000\n");
    one_bad_export_then_fifty_good(&broker, "big", |a| {
        a.publish("big/one", Bytes::from(vec![b'x'; 5_000]))
            .unwrap();
    })
    .await;
}

/// The same through metadata: a value with a newline (a stack trace, a
/// multi-line note) is a user property mosquitto refuses: refused here,
/// counted dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_export_with_a_newline_in_metadata_is_refused_and_counted() {
    let broker = Mosquitto::start();
    one_bad_export_then_fifty_good(&broker, "md", |a| {
        let md = Metadata::new().with("note", "line one\nline two");
        a.publish_with("md/multiline", Bytes::from_static(b"x"), md)
            .unwrap();
    })
    .await;
}

/// Node a exports `{root}/#` to node b through `broker`; `bad` publishes
/// one export the bridge must refuse, then 50 good ones follow. The bad one
/// is counted dropped, the 50 are sent and delivered, and the connection
/// stays up.
async fn one_bad_export_then_fifty_good(
    broker: &Mosquitto,
    root: &str,
    bad: impl FnOnce(&Bus<Bytes>),
) {
    const GOOD: u64 = 50;
    let filter = format!("{root}/#");
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = mqtt_node(&a, &broker.url(), "a", &[&filter], &[]).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &[&filter]).await;
        let seen = Seen::default();
        let _s = b.subscribe(&filter, seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        bad(&a);
        for i in 1..=GOOD {
            a.publish(&format!("{root}/n{i}"), Bytes::from_static(b"ok"))
                .unwrap();
        }
        until(
            || {
                let s = ba.stats();
                s.sent + s.dropped > GOOD
            },
            || format!("{:?}", ba.stats()),
        )
        .await;
        let delivered = settle(
            || seen.len() as u64,
            Duration::from_secs(2),
            Duration::from_secs(15),
        )
        .await;
        let sa: BridgeStats = ba.stats();
        assert_eq!(
            (delivered, sa.sent, sa.dropped, sa.reconnects),
            (GOOD, GOOD, 1, 0),
            "the bad one refused and counted, the rest sent and delivered, no connection lost: \
             b got {:?}, a: {sa:?}",
            seen.topics()
        );
    })
    .await;
}

/// A local subscriber whose filter holds a control character, inside an
/// import, is not subscribed upstream. (Before: mosquitto closed the
/// connection, and as the bridge resubscribes its whole table at every
/// ConnAck, the connection never stayed up: every other import of the node
/// was lost for as long as that one local subscriber existed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_a_local_filter_with_a_control_character_does_not_take_the_bridge_down() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = mqtt_node(&a, &broker.url(), "a", &["ok/#"], &[]).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &["#"]).await;
        let seen = Seen::default();
        let _good = b.subscribe("ok/x", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let _bad = b.subscribe("bad/tab\there", |_| {}).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        const N: u64 = 60;
        for _ in 0..N {
            a.publish("ok/x", Bytes::from_static(b"1")).unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let delivered = settle(|| seen.len() as u64, Duration::from_secs(1), Duration::from_secs(10)).await;
        let (sa, sb) = (ba.stats(), bb.stats());
        assert!(
            sb.reconnects == 0 && delivered + sb.dropped >= N - 2,
            "b lost its connection {} times and got {delivered} of {N} (dropped {}); a: {sa:?}, b: {sb:?}",
            sb.reconnects,
            sb.dropped
        );
    })
    .await;
}

// ---------------------------------------------------------------------------
// A panicking codec is contained: one message lost, counted.
// ---------------------------------------------------------------------------

/// JSON, but `encode` panics on 7 and `decode` on the payload `7`: a
/// stand-in for a user codec with a bug, or one that panics on input it
/// did not expect (the network is not trusted).
struct PanicsOnSeven;

impl Codec<u32> for PanicsOnSeven {
    fn encode(&self, value: &u32) -> Result<Bytes, CodecError> {
        assert!(*value != 7, "intentional test panic: encode 7");
        Ok(Bytes::from(value.to_string()))
    }
    fn decode(&self, bytes: Bytes) -> Result<u32, CodecError> {
        assert!(&bytes[..] != b"7", "intentional test panic: decode 7");
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| CodecError::new("not a number"))
    }
}

/// As the bus catches and counts a panicking handler, the bridge catches
/// its codec: one `encode` panic drops that export, counted. (Before: it
/// ended the export task, its taps were dropped, and every later export
/// vanished with neither `sent` nor `dropped` growing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_encode_drops_one_export_and_counts_it() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<u32>(), inline_bus::<u32>());
        let ba = start_node(
            Bridge::builder(&a).nats(server.url()).codec(PanicsOnSeven),
            "a",
            &["p/#"],
            &[],
        )
        .await;
        let bb = nats_node(&b, &server.url(), "b", &[], &["p/#"]).await;
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = Arc::clone(&got);
        let _s = b
            .subscribe("p/#", move |m| g.lock().unwrap().push(*m.data()))
            .unwrap();
        subscribed(&bb, 1).await;
        for i in 1..=20u32 {
            a.publish("p/x", i).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let accounted = settle(
            || {
                let s = ba.stats();
                s.sent + s.dropped
            },
            Duration::from_secs(2),
            Duration::from_secs(10),
        )
        .await;
        let sa = ba.stats();
        assert_eq!(
            accounted,
            20,
            "20 exports; sent + dropped = {accounted}; b got {:?}; a: {sa:?}",
            got.lock().unwrap()
        );
    })
    .await;
}

/// On the import side, a `decode` panic drops that import. (Before: it
/// ended the local filter's delivery task; what its queue held was dropped
/// uncounted, and every later message for that filter was refused by the
/// closed queue and counted as a *slow consumer*, never delivered: one
/// poison message from any client of the server disabled the filter.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_decode_drops_one_import_and_counts_it() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<u32>(), inline_bus::<u32>());
        let ba = start_node(
            Bridge::builder(&a).nats(server.url()).codec(PlainNumber),
            "a",
            &["q/#"],
            &[],
        )
        .await;
        let bb = start_node(
            Bridge::builder(&b).nats(server.url()).codec(PanicsOnSeven),
            "b",
            &[],
            &["q/#"],
        )
        .await;
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = Arc::clone(&got);
        let _s = b
            .subscribe("q/#", move |m| g.lock().unwrap().push(*m.data()))
            .unwrap();
        subscribed(&bb, 1).await;
        for i in 1..=20u32 {
            a.publish("q/x", i).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        until(|| ba.stats().sent == 20, || format!("{:?}", ba.stats())).await;
        let delivered = settle(
            || got.lock().unwrap().len() as u64,
            Duration::from_secs(2),
            Duration::from_secs(10),
        )
        .await;
        let sb = bb.stats();
        assert_eq!(
            delivered,
            19,
            "19 of 20 should arrive (7 is poison); got {:?}; b: {sb:?}",
            got.lock().unwrap()
        );
    })
    .await;
}

/// A codec that never panics (for the sending side of the decode test).
struct PlainNumber;

impl Codec<u32> for PlainNumber {
    fn encode(&self, value: &u32) -> Result<Bytes, CodecError> {
        Ok(Bytes::from(value.to_string()))
    }
    fn decode(&self, bytes: Bytes) -> Result<u32, CodecError> {
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| CodecError::new("not a number"))
    }
}

// ---------------------------------------------------------------------------
// NATS mapping: only the subjects the mapping makes map back to topics.
// ---------------------------------------------------------------------------

/// `subject_to_topic` gives `None` for a subject this mapping does not
/// make. It accepted `/` inside a token (`a.b/c` became `a/b/c`, three
/// levels from two tokens), lower-case and needless escapes (`%2e`, `%41`),
/// and a sign inside an escape (`%+1`, from `u8::from_str_radix`): several
/// subjects stood for one topic.
#[test]
fn subject_to_topic_accepts_only_subjects_the_mapping_makes() {
    let mut wrong = Vec::new();
    for subject in ["orders.eu/42", "a.b%2Fc", "a.%2e", "a.%41", "a.%+1"] {
        if let Some(topic) = subject_to_topic(subject) {
            let back = topic_to_subject(&topic);
            if back != subject {
                wrong.push(format!("{subject:?} -> {topic:?} -> {back:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "not inverse: {wrong:#?}");
}

/// End to end: a NATS client publishes to `orders.eu/42` (a `/` is legal
/// in a NATS token). It is no subject of this mapping: dropped and counted
/// in `decode_errors`. (Before: a local `orders/#` got it under a topic of
/// three levels, and the `orders/+` copy was dropped with no count.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_subject_with_a_slash_is_counted_as_a_decode_error() {
    let server = NatsServer::start();
    limit(60, async {
        let b = inline_bus::<Bytes>();
        let bb = nats_node(&b, &server.url(), "b", &[], &["orders/#"]).await;
        let (plus, hash) = (Seen::default(), Seen::default());
        let _p = b.subscribe("orders/+", plus.handler()).unwrap();
        let _h = b.subscribe("orders/#", hash.handler()).unwrap();
        subscribed(&bb, 2).await; // one per local filter (`orders/#` holds two subjects)
        let raw = async_nats::connect(server.url()).await.unwrap();
        raw.publish("orders.eu/42", Bytes::from_static(b"x"))
            .await
            .unwrap();
        raw.publish("orders.ok", Bytes::from_static(b"y"))
            .await
            .unwrap();
        raw.flush().await.unwrap();
        until(
            || plus.len() >= 1 && hash.len() >= 1,
            || format!("{:?}", bb.stats()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let s = bb.stats();
        assert!(
            hash.topics() == ["orders/ok"] && s.decode_errors >= 1,
            "orders.eu/42 should be refused and counted in decode_errors; \
             orders/# got {:?}, orders/+ got {:?}; {s:?}",
            hash.topics(),
            plus.topics()
        );
    })
    .await;
}

// ---------------------------------------------------------------------------
// Metadata whose key is the bridge's origin header.
// ---------------------------------------------------------------------------

/// The origin travels as the header `Blazesub-Origin`; a metadata pair
/// with that key arrives as metadata, and the origin stays the sender's.
/// (Before: the pair replaced the origin header (`HeaderMap::insert`) and
/// was read back as the origin: lost without a count, and the receiver
/// took the user's value for the sending node's id.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_named_like_the_origin_header_arrives() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = nats_node(&a, &server.url(), "a", &["h/#"], &[]).await;
        let bb = nats_node(&b, &server.url(), "b", &[], &["h/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("h/+", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let md = Metadata::new()
            .with("Blazesub-Origin", "upstream-service")
            .with("k", "v");
        a.publish_with("h/x", Bytes::from_static(b"1"), md).unwrap();
        until(
            || seen.len() == 1,
            || format!("{:?} {:?}", ba.stats(), bb.stats()),
        )
        .await;
        let md = seen.0.lock().unwrap()[0].2.clone().unwrap();
        assert_eq!(
            (md.get("k"), md.get("Blazesub-Origin")),
            (Some("v"), Some("upstream-service")),
            "every metadata pair should arrive, or the loss be counted: {:?} {:?}",
            ba.stats(),
            bb.stats()
        );
    })
    .await;
}

// ---------------------------------------------------------------------------
// Two bridges of one bus share its origin id.
// ---------------------------------------------------------------------------

/// A bus with one bridge exporting `o/#` and another importing `o/#` (one
/// per direction, or an exporter of some topics and an importer of `#`)
/// does not get its own exports back: the origin id is the bus's, and
/// `no_echo` is only per connection. (Before: made per `Bridge`, so local
/// subscribers saw each message twice, counted as `received`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bridges_of_one_bus_do_not_echo_to_each_other() {
    let server = NatsServer::start();
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let out = nats_node(&a, &server.url(), "out", &["o/#"], &[]).await;
        let inb = nats_node(&a, &server.url(), "in", &[], &["o/#"]).await;
        let seen = Seen::default();
        let _s = a.subscribe("o/+", seen.handler()).unwrap();
        subscribed(&inb, 1).await;
        a.publish("o/1", Bytes::from_static(b"1")).unwrap();
        until(|| out.stats().sent == 1, || format!("{:?}", out.stats())).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            seen.topics(),
            ["o/1"],
            "out: {:?}, in: {:?}",
            out.stats(),
            inb.stats()
        );
    })
    .await;
}
