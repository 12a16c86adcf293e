//! MQTT bridge edges a demanding user hits, against a real `mosquitto`.
//! Each test has a time limit.
#![cfg(feature = "mqtt")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/mosquitto.rs"]
mod mosquitto;

use std::time::Duration;

use blazesub::bridge::Bridge;
use blazesub::Bus;
use bridge_support::{inline_bus, limit, start_node, subscribed, Seen};
use bytes::Bytes;
use mosquitto::Mosquitto;

async fn node(
    bus: &Bus<Bytes>,
    url: &str,
    name: &str,
    exports: &[&str],
    imports: &[&str],
    at_least_once: bool,
) -> Bridge {
    let mut builder = Bridge::builder(bus)
        .mqtt(url)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
    if at_least_once {
        builder = builder.at_least_once(Duration::from_secs(60));
    }
    start_node(builder, name, exports, imports).await
}

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
        let ba = node(&a, &broker.url(), "a", &["t/#"], &[], false).await;
        let bb = node(&b, &broker.url(), "b", &[], &["t/#", &long_import], false).await;
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
        let bc = node(&c, &broker.url(), "c", &[], &["#"], false).await;
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
        let ba = node(&a, &broker.url(), "a", &["t/#"], &[], false).await;
        let bb = node(&b, &broker.url(), "b", &[], &["#"], false).await;
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
        let bc = node(&c, &broker.url(), "c", &[], &["#"], false).await;
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
