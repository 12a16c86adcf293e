//! MQTT bridge edges a demanding user hits, against a real `mosquitto`:
//! upstream filters MQTT or the broker cannot take; and, kept as guards
//! (they passed before), metadata with odd keys, closing while the broker
//! is down, and exports across a broker restart, each counted once.
//! Each test has a time limit.
#![cfg(feature = "mqtt")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/mosquitto.rs"]
mod mosquitto;

use std::time::{Duration, Instant};

use bridge_support::{inline_bus, limit, mqtt_node, subscribed, until, Seen};
use bytes::Bytes;
use mosquitto::Mosquitto;

/// A local filter and an import, each within MQTT's 65,535 bytes, whose
/// intersection (the upstream filter) is longer: rumqttc would write its
/// length truncated, the broker close the connection, and the bridge
/// subscribe again on every ConnAck, so the connection would never hold.
/// The filter must be refused (logged), the rest of the bridge unharmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_filter_over_mqtts_string_limit_does_not_take_the_bridge_down() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let long_import = format!("+/{}", "y".repeat(40_000));
        let ba = mqtt_node(&a, &broker.url(), "a", &["t/#"], &[], false).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &["t/#", &long_import], false).await;
        let seen = Seen::default();
        let _t = b.subscribe("t/#", seen.handler()).unwrap();
        // `t/#` ∩ `+/y…y` is `t/y…y`, within the limit.
        subscribed(&bb, 2).await;
        // `x…x/+` ∩ `+/y…y` is `x…x/y…y`: 80,001 bytes.
        let long_local = format!("{}/+", "x".repeat(40_000));
        let _long = b.subscribe(&long_local, |_| {}).unwrap();
        // And one there before the bridge connects, when the broker's
        // limit is not known yet: it may cost that first connection, no
        // more (it was queued in the client already).
        let c = inline_bus::<Bytes>();
        let _early = c.subscribe(&long_local, |_| {}).unwrap();
        let c_seen = Seen::default();
        let _ct = c.subscribe("t/#", c_seen.handler()).unwrap();
        let bc = mqtt_node(&c, &broker.url(), "c", &[], &["#"], false).await;
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        for i in 0..20 {
            a.publish(&format!("t/{i}"), Bytes::from_static(b"1"))
                .unwrap();
        }
        let arrived = tokio::time::timeout(Duration::from_secs(5), async {
            while seen.len() < 20 || c_seen.len() < 20 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        let (sa, sb, sc) = (ba.stats(), bb.stats(), bc.stats());
        assert!(
            arrived.is_ok() && sb.reconnects == 0 && sc.reconnects <= 1,
            "{} and {} of 20 arrived; a {sa:?}; b {sb:?}; c {sc:?}",
            seen.len(),
            c_seen.len()
        );
    })
    .await;
}

/// A broker whose Maximum Packet Size is smaller than a SUBSCRIBE the
/// bridge would send for a long local filter: that filter cannot be
/// subscribed, and must not keep the connection down for the others
/// (resubscribed on every ConnAck, it would fail each connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_over_the_brokers_maximum_packet_size_does_not_take_the_bridge_down() {
    let broker = Mosquitto::start_with("max_packet_size 1000\n");
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = mqtt_node(&a, &broker.url(), "a", &["t/#"], &[], false).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &["#"], false).await;
        let seen = Seen::default();
        let _t = b.subscribe("t/#", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let long_local = format!("{}/+", "x".repeat(2_000));
        let _long = b.subscribe(&long_local, |_| {}).unwrap();
        // And one there before the bridge connects, when the broker's
        // limit is not known yet: it may cost that first connection, no
        // more (it was queued in the client already).
        let c = inline_bus::<Bytes>();
        let _early = c.subscribe(&long_local, |_| {}).unwrap();
        let c_seen = Seen::default();
        let _ct = c.subscribe("t/#", c_seen.handler()).unwrap();
        let bc = mqtt_node(&c, &broker.url(), "c", &[], &["#"], false).await;
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        for i in 0..20 {
            a.publish(&format!("t/{i}"), Bytes::from_static(b"1"))
                .unwrap();
        }
        let arrived = tokio::time::timeout(Duration::from_secs(5), async {
            while seen.len() < 20 || c_seen.len() < 20 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        let (sa, sb, sc) = (ba.stats(), bb.stats(), bc.stats());
        assert!(
            arrived.is_ok() && sb.reconnects == 0 && sc.reconnects <= 1,
            "{} and {} of 20 arrived; a {sa:?}; b {sb:?}; c {sc:?}",
            seen.len(),
            c_seen.len()
        );
    })
    .await;
}

/// Metadata with keys MQTT allows but that look odd: empty, the origin
/// property's own name, spaces, colons, non-ASCII; empty values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_with_odd_keys_arrives_whole() {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = mqtt_node(&a, &broker.url(), "a", &["m/#"], &[], false).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &["m/#"], false).await;
        let seen = Seen::default();
        let _m = b.subscribe("m/#", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let md = blazesub::Metadata::new()
            .with("", "empty key")
            .with("blazesub-origin", "someone else")
            .with("a key", "")
            .with("x:y", "v:w")
            .with("ключ", "значение");
        a.publish_with("m/1", Bytes::from_static(b"1"), md.clone())
            .unwrap();
        until(
            || seen.len() == 1,
            || format!("{:?} {:?}", ba.stats(), bb.stats()),
        )
        .await;
        let got = seen.0.lock().unwrap()[0].2.clone();
        assert_eq!(got, Some(md), "a {:?}; b {:?}", ba.stats(), bb.stats());
    })
    .await;
}

/// The broker dies; exports published while it is down, then `close`:
/// the close is prompt, and every export is counted once.
async fn close_while_the_broker_is_down(at_least_once: bool) {
    let mut broker = Mosquitto::start();
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let ba = mqtt_node(&a, &broker.url(), "a", &["t/#"], &[], at_least_once).await;
        for i in 0..10 {
            a.publish(&format!("t/{i}"), Bytes::from_static(b"1"))
                .unwrap();
        }
        until(|| ba.stats().sent == 10, || format!("{:?}", ba.stats())).await;
        broker.kill();
        until(|| !ba.stats().connected, || format!("{:?}", ba.stats())).await;
        for i in 0..50 {
            a.publish(&format!("t/{i}"), Bytes::from_static(b"1"))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        ba.close().await.unwrap();
        let took = started.elapsed();
        let s = ba.stats();
        assert!(took < Duration::from_secs(3), "close took {took:?}");
        assert_eq!((s.sent, s.dropped), (10, 50), "{s:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_while_the_broker_is_down_qos0() {
    close_while_the_broker_is_down(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_while_the_broker_is_down_qos1() {
    close_while_the_broker_is_down(true).await;
}

/// Exports published steadily while the broker restarts: each is counted
/// once, `sent` or `dropped`, before `close` too. (At QoS 1 not all that
/// `sent` counts arrives: the restarted broker, without persistence, lost
/// b's session, and acknowledges a's exports before b subscribes again.)
async fn exports_across_a_broker_restart(at_least_once: bool) {
    let mut broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = mqtt_node(&a, &broker.url(), "a", &["t/#"], &[], at_least_once).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &["t/#"], at_least_once).await;
        let seen = Seen::default();
        let _t = b.subscribe("t/#", seen.handler()).unwrap();
        subscribed(&bb, 1).await;
        let n = 600u64;
        for i in 0..n {
            a.publish(&format!("t/{i}"), Bytes::from_static(b"1"))
                .unwrap();
            if i == 200 {
                broker.kill();
            }
            if i == 400 {
                broker.restart();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let settled = tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                let s = ba.stats();
                if s.sent + s.dropped == n {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let sa = ba.stats();
        assert!(settled.is_ok(), "not every export counted: a {sa:?}");
        ba.close().await.unwrap();
        bb.close().await.unwrap();
        let (sa, sb) = (ba.stats(), bb.stats());
        assert_eq!(sa.sent + sa.dropped, n, "after close: a {sa:?}; b {sb:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_across_a_broker_restart_qos0() {
    exports_across_a_broker_restart(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_across_a_broker_restart_qos1() {
    exports_across_a_broker_restart(true).await;
}
