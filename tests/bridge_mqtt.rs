//! The bridge over MQTT 5 (feature `mqtt`) against a real `mosquitto`:
//! cross-node delivery with metadata as user properties, overlapping
//! filters (mosquitto sends one copy per matching subscription, each with
//! its subscription identifier), two local filters sharing one upstream
//! filter, three nodes with no loops (No Local), a broker restart (the
//! session starts clean: the bridge resubscribes from its table), bad
//! payloads; and against an embedded rumqttd, which ignores No Local, the
//! origin property stopping echoes.
//!
//! Needs `mosquitto` (Debian: `apt-get install -y mosquitto`); without it
//! these tests fail, never skip. Each test has a time limit.
#![cfg(feature = "mqtt")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/mosquitto.rs"]
mod mosquitto;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::bridge::Bridge;
use blazesub::{Bus, Metadata};
use bridge_support::{inline_bus, limit, start_node, subscribed, until, Seen};
use bytes::Bytes;
use mosquitto::Mosquitto;

async fn node<T>(bus: &Bus<T>, url: &str, name: &str, exports: &[&str], imports: &[&str]) -> Bridge
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let builder = Bridge::builder(bus)
        .mqtt(url)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
    start_node(builder, name, exports, imports).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_node_delivery_with_user_properties() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &broker.url(), "a", &["orders/#"], &[]).await;
        let bb = node(&b, &broker.url(), "b", &[], &["orders/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("orders/+/+", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let topics = ["orders/eu/42", "orders//", "orders/a.b c/*>%"];
        for topic in topics {
            let md = Metadata::new().with("trace-id", "7f:3a").with("é", "ü");
            a.publish_with(topic, Bytes::from(topic.as_bytes().to_vec()), md)
                .unwrap();
        }
        until(|| seen.len() == 3, || format!("{:?}", bb.stats())).await;
        let got = seen.0.lock().unwrap().clone();
        for (i, (topic, payload, md)) in got.iter().enumerate() {
            assert_eq!(topic, topics[i], "in publish order");
            assert_eq!(&payload[..], topics[i].as_bytes());
            let md = md.as_ref().expect("metadata travels");
            assert_eq!(
                (md.get("trace-id"), md.get("é")),
                (Some("7f:3a"), Some("ü"))
            );
        }
        assert_eq!((ba.stats().sent, bb.stats().received), (3, 3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_and_shared_upstream_filters_deliver_once_each() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let _ba = node(&a, &broker.url(), "a", &["a/#"], &[]).await;
        let bb = node(&b, &broker.url(), "b", &[], &["a/#"]).await;
        let (hash, plus, all) = (Seen::default(), Seen::default(), Seen::default());
        let _h = b.subscribe("a/#", hash.handler()).unwrap();
        let _p = b.subscribe("a/+", plus.handler()).unwrap();
        // `#` ∩ `a/#` is `a/#` again: one MQTT subscription for two local filters.
        let _all = b.subscribe("#", all.handler()).unwrap();
        subscribed(&bb, 3).await;
        a.publish("a/x", Bytes::from_static(b"1")).unwrap();
        a.publish("a", Bytes::from_static(b"2")).unwrap();
        a.publish("a/x/y", Bytes::from_static(b"3")).unwrap();
        until(
            || hash.len() == 3 && plus.len() == 1 && all.len() == 3,
            || format!("{:?}", bb.stats()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(hash.sorted_topics(), ["a", "a/x", "a/x/y"]);
        assert_eq!(plus.sorted_topics(), ["a/x"]);
        assert_eq!(all.sorted_topics(), ["a", "a/x", "a/x/y"]);
        assert_eq!(bb.stats().received, 7);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_export_and_import_one_namespace_without_loops() {
    let broker = Mosquitto::start();
    limit(60, async {
        let mut nodes = Vec::new();
        for n in 0..3 {
            let bus = inline_bus::<Bytes>();
            let bridge = node(
                &bus,
                &broker.url(),
                &format!("peer-{n}"),
                &["chat/#"],
                &["chat/#"],
            )
            .await;
            let seen = Seen::default();
            let sub = bus.subscribe("chat/#", seen.handler()).unwrap();
            subscribed(&bridge, 1).await;
            nodes.push((bus, bridge, seen, sub));
        }
        for (n, (bus, ..)) in nodes.iter().enumerate() {
            bus.publish(&format!("chat/from-{n}"), Bytes::from_static(b"hi"))
                .unwrap();
        }
        for (_, bridge, seen, _) in &nodes {
            until(|| seen.len() == 3, || format!("{:?}", bridge.stats())).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (_, bridge, seen, _) in &nodes {
            assert_eq!(
                seen.sorted_topics(),
                ["chat/from-0", "chat/from-1", "chat/from-2"]
            );
            let stats = bridge.stats();
            assert_eq!((stats.sent, stats.received), (1, 2), "no echo, no loop");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_resubscribes_from_the_bridges_table() {
    let mut broker = Mosquitto::start();
    limit(90, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &broker.url(), "a", &["jobs/#"], &[]).await;
        let bb = node(&b, &broker.url(), "b", &[], &["jobs/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("jobs/+", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        a.publish("jobs/1", Bytes::from_static(b"1")).unwrap();
        until(|| seen.len() == 1, || format!("{:?}", bb.stats())).await;

        broker.kill();
        until(
            || !ba.stats().connected && !bb.stats().connected,
            || "the bridges did not notice".into(),
        )
        .await;
        broker.restart();
        until(
            || ba.stats().connected && bb.stats().connected,
            || "the bridges did not reconnect".into(),
        )
        .await;
        assert!(ba.stats().reconnects >= 1 && bb.stats().reconnects >= 1);
        // The new session knows nothing: only the bridge's resubscribe
        // brings the message. Publish until it lands.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !seen.sorted_topics().iter().any(|t| t == "jobs/after") {
            assert!(Instant::now() < deadline, "no delivery after the restart");
            a.publish("jobs/after", Bytes::from_static(b"2")).unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(bb.stats().upstream_subscriptions, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_payloads_are_counted_not_fatal() {
    let broker = Mosquitto::start();
    limit(60, async {
        let raw = inline_bus::<Bytes>();
        let _br = node(&raw, &broker.url(), "raw", &["data/#"], &[]).await;
        let typed = inline_bus::<Vec<u32>>();
        let bt = node(&typed, &broker.url(), "typed", &[], &["data/#"]).await;
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = Arc::clone(&got);
        let _s = typed
            .subscribe("data/#", move |m| g.lock().unwrap().push(m.data().clone()))
            .unwrap();
        subscribed(&bt, 1).await;
        raw.publish("data/x", Bytes::from_static(b"not json"))
            .unwrap();
        raw.publish("data/y", Bytes::from_static(b"[1,2,3]"))
            .unwrap();
        until(
            || got.lock().unwrap().len() == 1 && bt.stats().decode_errors == 1,
            || format!("{:?}", bt.stats()),
        )
        .await;
        assert_eq!(*got.lock().unwrap(), [vec![1, 2, 3]]);
    })
    .await;
}

/// An embedded rumqttd with an MQTT 5 listener on a free port. rumqttd
/// cannot be stopped: its threads end with the test process.
fn rumqttd_v5() -> String {
    use rumqttd::{Broker, Config, ConnectionSettings, RouterConfig, ServerSettings};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let server = ServerSettings {
        name: "v5".into(),
        listen: ([127, 0, 0, 1], port).into(),
        tls: None,
        next_connection_delay_ms: 1,
        connections: ConnectionSettings {
            connection_timeout_ms: 5_000,
            max_payload_size: 1 << 20,
            max_inflight_count: 100,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    let config = Config {
        id: 0,
        router: RouterConfig {
            max_connections: 64,
            max_outgoing_packet_count: 200,
            max_segment_size: 1 << 20,
            max_segment_count: 10,
            ..RouterConfig::default()
        },
        v5: Some([("v5".to_string(), server)].into_iter().collect()),
        ..Config::default()
    };
    std::thread::spawn(move || {
        let mut broker = Broker::new(config);
        let _ = broker.start();
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "rumqttd did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    format!("mqtt://127.0.0.1:{port}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_property_stops_echoes_where_the_broker_ignores_no_local() {
    let url = rumqttd_v5();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &url, "a", &["echo/#"], &["echo/#"]).await;
        let bb = node(&b, &url, "b", &["echo/#"], &["echo/#"]).await;
        let (seen_a, seen_b) = (Seen::default(), Seen::default());
        let _sa = a.subscribe("echo/#", seen_a.handler()).unwrap();
        let _sb = b.subscribe("echo/#", seen_b.handler()).unwrap();
        subscribed(&ba, 1).await;
        subscribed(&bb, 1).await;
        a.publish("echo/1", Bytes::from_static(b"1")).unwrap();
        until(|| seen_b.len() == 1, || format!("{:?}", bb.stats())).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            seen_a.sorted_topics(),
            ["echo/1"],
            "a's own subscriber: once, locally"
        );
        assert_eq!(
            seen_b.sorted_topics(),
            ["echo/1"],
            "b: once, and not sent back"
        );
        let (sa, sb) = (ba.stats(), bb.stats());
        assert_eq!((sa.sent, sa.received), (1, 0), "{sa:?}");
        assert_eq!((sb.sent, sb.received), (0, 1), "{sb:?}");
        // rumqttd sent a's message back to a (it ignores No Local); the
        // origin property dropped it.
        assert!(sa.echoes >= 1, "{sa:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_cross_and_oversized_ones_are_refused_not_fatal() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &broker.url(), "a", &["big/#"], &[]).await;
        let bb = node(&b, &broker.url(), "b", &[], &["big/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("big/+", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        // rumqttc's default limit is 10 KiB; the bridge raises it to 1 MiB.
        a.publish("big/100k", Bytes::from(vec![7u8; 100_000]))
            .unwrap();
        a.publish("big/2m", Bytes::from(vec![7u8; 2 << 20]))
            .unwrap();
        a.publish("big/after", Bytes::from_static(b"small"))
            .unwrap();
        until(
            || seen.len() == 2,
            || format!("{:?} {:?}", ba.stats(), bb.stats()),
        )
        .await;
        assert_eq!(seen.sorted_topics(), ["big/100k", "big/after"]);
        assert_eq!(seen.0.lock().unwrap()[0].1.len(), 100_000);
        // b may have the last one before a's export task counts it sent.
        until(
            || {
                let s = ba.stats();
                s.sent + s.dropped == 3
            },
            || format!("{:?}", ba.stats()),
        )
        .await;
        let (sa, sb) = (ba.stats(), bb.stats());
        assert_eq!(
            (sa.sent, sa.dropped),
            (2, 1),
            "the 2 MiB one refused, counted"
        );
        assert_eq!((sa.reconnects, sb.reconnects), (0, 0), "no connection lost");
    })
    .await;
}

/// After `close` the bridge stays closed: its event loop ends instead of
/// reconnecting (rumqttc reconnects whenever it is polled), so a new client
/// with the same client id is not pushed off the broker by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_stays_closed() {
    let broker = Mosquitto::start();
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let first = node(&a, &broker.url(), "a", &["x/#"], &[]).await;
        first.close().await.unwrap();
        let second = node(&a, &broker.url(), "a", &["x/#"], &[]).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (s1, s2) = (first.stats(), second.stats());
        assert_eq!(s1.reconnects, 0, "the closed bridge reconnected: {s1:?}");
        assert!(!s1.connected, "{s1:?}");
        assert_eq!(
            s2.reconnects, 0,
            "pushed off by its closed namesake: {s2:?}"
        );
        second.close().await.unwrap();
    })
    .await;
}

/// MQTT strings carry a u16 length, and rumqttc writes a longer one
/// truncated (a malformed packet: the broker closes the connection). A
/// metadata value or key over 65,535 bytes, fine on the bus and far under
/// the packet limit, is refused before the client and counted as dropped;
/// the connection stays up and the next message arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_string_over_mqtts_limit_is_refused_not_fatal() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &broker.url(), "a", &["m/#"], &[]).await;
        let bb = node(&b, &broker.url(), "b", &[], &["m/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("m/+", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let long = "v".repeat(70_000);
        let value = Metadata::new().with("k", long.as_str());
        a.publish_with("m/value", Bytes::from_static(b"x"), value)
            .unwrap();
        let key = Metadata::new().with(long.as_str(), "v");
        a.publish_with("m/key", Bytes::from_static(b"x"), key)
            .unwrap();
        let fits = Metadata::new().with("k", "v".repeat(65_535));
        a.publish_with("m/after", Bytes::from_static(b"x"), fits)
            .unwrap();
        until(
            || seen.len() == 1,
            || format!("{:?} {:?}", ba.stats(), bb.stats()),
        )
        .await;
        assert_eq!(seen.topics(), ["m/after"]);
        let sa = ba.stats();
        assert_eq!(
            (sa.sent, sa.dropped),
            (1, 2),
            "both refused, counted: {sa:?}"
        );
        assert_eq!(
            (sa.reconnects, bb.stats().reconnects),
            (0, 0),
            "no connection lost"
        );
    })
    .await;
}
